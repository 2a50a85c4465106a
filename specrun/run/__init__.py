"""Running a pair: how to load it (``config``), its devices (``inventory``), the header-only
assessment (``pair``), opening it (``session``), chat prompts and templates (``prompt``,
``template``), tool calls (``toolcalls``), the engine's rounds as frozen events (``stream``,
``text``) and multi-turn chat (``chat``)."""
