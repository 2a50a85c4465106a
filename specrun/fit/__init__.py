"""Where a pair goes: the memory each model needs per device (``memory``), how its layers are
placed across devices (``placement``) and the RPC workers' endpoints and handshake (``rpc``)."""
