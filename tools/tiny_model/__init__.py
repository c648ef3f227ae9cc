"""The tiny test model behind `model: builtin:tiny`: its builder (build.py), its cut-down Qwen
tokenizer (tokenizer.py) and the text it is trained on (data/)."""
