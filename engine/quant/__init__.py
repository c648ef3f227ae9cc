"""Weight-only quantization: the engine's one in-memory form of a quantized matrix, which every
weight format's loader (GGUF, compressed-tensors, GPTQ / AWQ) converts into and the kernels
(C on CPU, Triton on GPU) pack for themselves."""
