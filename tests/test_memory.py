"""Memory per device (specrun/fit/memory.py) on hand-built Llama-shaped headers: the layers cut as
llama.cpp cuts them, and the per-device estimate adding up."""

from __future__ import annotations

import pytest
from big_models import big_models, llama_like

from specrun.fit.memory import estimate, layer_devices
from specrun.gguf.facts import model_info


@pytest.fixture(scope="module")
def big():
    return big_models()


def test_the_synthetic_models_are_the_sizes_of_the_real_ones(big):
    assert 40e9 < big["70b"].weights_bytes < 45e9  # Llama-3.1-70B Q4_K_M is about 42.5 GB
    assert 4.3e9 < big["8b"].weights_bytes < 5.3e9  # 8B Q4_K_M: about 4.9 GB


def test_layers_are_cut_as_llama_cpp_cuts_them():
    # every layer offloaded, 3:1 over two devices: the first three quarters to the first
    assert layer_devices(3, -1, ("A", "B"), (3.0, 1.0)) == ["A", "A", "A", "B"]
    # the last gpu_layers are offloaded; the rest (from layer 0) stay on the CPU
    assert layer_devices(5, 2, ("A",), (1.0,)) == ["CPU", "CPU", "CPU", "CPU", "A", "A"]
    assert layer_devices(4, -1, (), ()) == ["CPU"] * 5
    # a device given 0 gets nothing
    assert "B" not in layer_devices(9, -1, ("A", "B", "C"), (1.0, 0.0, 1.0))


def test_per_device_estimate_adds_up(big):
    m = big["70b"]
    one = estimate(m, "target", 4096, -1)  # all on the CPU
    two = estimate(m, "target", 4096, -1, ("CUDA0", "CUDA1"), (0.5, 0.5))
    assert one.weights == m.weights_bytes and one.on_devices == 0
    # the same weights and KV, moved; each device gets its own compute buffer and runtime
    assert two.weights == one.weights and two.kv_cache == one.kv_cache
    assert abs(two.by_device["CUDA0"] - two.by_device["CUDA1"]) < 0.06 * two.by_device["CUDA0"]
    assert two.on_host < 0.03 * two.total  # the token embeddings and the runtime
    tied = model_info(llama_like("tied", 2, 256, 512, 4, 2, [f"t{i}" for i in range(1000)]))
    tied.header.tensors[:] = [t for t in tied.header.tensors if t.name != "output.weight"]
    on_gpu = estimate(tied, "target", 512, -1, ("CUDA0",), (1.0,))
    embd = next(t.nbytes for t in tied.header.tensors if t.name == "token_embd.weight")
    assert on_gpu.weights == tied.weights_bytes + embd  # tied embeddings are copied to the output layer's device
