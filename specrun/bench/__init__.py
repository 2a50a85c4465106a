"""Measuring: plain against each mode, interleaved (``runner``), llama.cpp's own tools among
them (``llamacpp``), and the network's share of a verify through RPC workers (``network``)."""
