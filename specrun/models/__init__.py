"""Finding model files: the user's registry (``registry``, models.toml), Ollama / LM Studio /
Hugging Face stores (``stores``), every known GGUF summarised (``catalog``), which files can
draft for a target (``discovery``) and ``pull`` (``download``)."""
