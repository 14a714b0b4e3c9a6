"""``ops.apply_to`` with FSDP2 (``fully_shard``), in two CPU processes over gloo: a tiny Llama patched before it is
sharded gives the sharded unpatched model's logits and every gradient; patched after, its sharded norms are skipped
and reported (a replacement module would keep its parameter sharded: FSDP2 gathers the parameters of the modules it
was given) and it still gives the unpatched logits."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import ops
from ops.tolerance import compare

pytest.importorskip("transformers")
if not dist.is_available():
    pytest.skip("torch.distributed is not available", allow_module_level=True)

WORLD = 2


def tiny_llama() -> torch.nn.Module:
    """A two-layer random Llama (seed 0), float32."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_key_value_heads=2, head_dim=16,
                                      vocab_size=128, num_hidden_layers=2, num_attention_heads=4)
    return transformers.LlamaForCausalLM(config)


def shard(model: torch.nn.Module) -> None:
    """FSDP2 as its documentation shards a decoder: each layer, then the model."""
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)


def check_rank(rank: int, init: str, order: str) -> None:
    """One process: the patched and the unpatched model, both sharded, on this rank's own batch."""
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)
    try:
        ref = tiny_llama()
        model = copy.deepcopy(ref)
        if order == "patch_first":
            report = ops.apply_to(model).report
            shard(model)
            assert (len(report.replaced), len(report.fused), report.skipped) == (5, 2, []), str(report)
        else:
            shard(model)
            report = ops.apply_to(model).report
            assert not report.replaced and not report.fused, str(report)
            assert sum("sharded" in why for _, _, why in report.skipped) == 5, str(report)
        shard(ref)
        torch.manual_seed(1 + rank)
        ids = torch.randint(0, 128, (2, 8))
        logits, want = model(ids).logits, ref(ids).logits
        assert (m := compare(logits, want, torch.float32, reduction=64)) is None, m
        logits.square().mean().backward()
        want.square().mean().backward()
        for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
            got, wanted = p.grad.full_tensor(), q.grad.full_tensor()
            assert (m := compare(got, wanted, torch.float32, reduction=2 * 8 * 128, cond=4.0)) is None, f"{name}: {m}"
        dist.barrier()   # both ranks done before either tears gloo down (a peer torn down mid-exchange aborts)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("order", ["patch_first", "shard_first"])
def test_fsdp2_sharded_model_gives_the_unpatched_logits_and_gradients(tmp_path: object, order: str) -> None:
    mp.spawn(check_rank, args=(f"file://{tmp_path}/store", order), nprocs=WORLD)
