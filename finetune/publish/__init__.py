"""`finetune publish`: a run, a merged model or a GGUF export to a Hugging Face Hub repository, with a model card.

`contents` decides what is uploaded from what (an allow-list per kind of folder; nothing that names a local path or
holds a token), `scrub` takes local paths and secrets out of the recipe, `card` writes the model card, `upload`
sends it all through huggingface_hub (create_repo, create_commit).
"""
