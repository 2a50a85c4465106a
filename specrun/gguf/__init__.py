"""What a GGUF file's header says, read without its weights: the bounded reader (``header``),
the one model record (``facts``), the architecture's rollback and state (``architecture``),
built-in and separate draft heads (``heads``) and the vocabulary rules (``vocabulary``)."""
