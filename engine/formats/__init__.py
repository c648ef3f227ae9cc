"""Weight formats users bring, read as they are stored: one module per format (gguf.py: llama.cpp's
GGUF), each handing over a Hugging Face-style config dict and tensors under Hugging Face names,
quantized matrices as engine.quant.QuantizedWeight (never dequantized to a float checkpoint)."""
