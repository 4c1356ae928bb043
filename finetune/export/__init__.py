"""After training, into the places models are served: `finetune export` (GGUF + Ollama Modelfile, verified).

The work is llama.cpp's (its converter and quantizer); finetune checks before, sets the metadata the run implies,
and reads the result back (finetune.export.gguf_export has the order).
"""
