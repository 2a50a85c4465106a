"""The only package that touches llama_cpp (the import contract says so): llama.cpp loaded once
(``ffi``), the devices ggml sees (``devices``), a loaded model and its rollback (``model``), the
draft heads riding on a target's context (``heads``; a block drafter, ``dflash``), and several sequences decoding through one
batch (``gate``). Importing it loads llama_cpp, so header-only commands import it lazily."""

from specrun.llama.devices import (
    Device,
    add_workers,
    devices,
    rpc_protocol_built,
    serve,
    supports_gpu_offload,
    supports_rpc,
    worker_devices,
    workers,
)
from specrun.llama.dflash import Block, DFlashHead
from specrun.llama.ffi import live_batches, version
from specrun.llama.gate import Gate, Sequence, on_own_thread
from specrun.llama.heads import DraftHead, Eagle3Head, Gemma4Assistant, MtpHeads
from specrun.llama.model import ROLLBACK_METHODS, LoadOptions, Model, Offload, RollbackStats

__all__ = [
    "Block", "Device", "DFlashHead", "DraftHead", "Eagle3Head", "Gate", "Gemma4Assistant", "LoadOptions", "Model", "MtpHeads", "Offload",
    "ROLLBACK_METHODS", "RollbackStats", "Sequence", "add_workers", "devices", "live_batches", "on_own_thread",
    "rpc_protocol_built", "serve", "supports_gpu_offload", "supports_rpc", "version", "worker_devices", "workers",
]  # fmt: skip
