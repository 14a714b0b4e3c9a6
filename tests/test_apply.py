"""``ops.apply_to``: a model's norms replaced in place by type, sharing their parameters, undone by the handle; tiny
Hugging Face models (where ``transformers`` is installed: ``pip install -e .[hf]``) give the unpatched model's
logits and gradients."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ops
from ops.common import loaded_class_entry
from ops.layernorm import LayerNorm
from ops.rmsnorm import RMSNorm
from ops.tolerance import compare


class OwnNorm(nn.Module):
    """A norm class the library does not know: left alone and reported."""

    def __init__(self, h: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(h))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


def test_plain_model_swapped_in_place_and_restored(device: str) -> None:
    """nn.LayerNorm and nn.RMSNorm (one of them sitting in two places) become ours on the same parameters, with the
    same state dict and outputs; a class it does not know is skipped and reported; remove() and the with block put
    the very same modules back; norms=False changes nothing."""
    torch.manual_seed(0)
    shared = nn.RMSNorm(16, eps=1e-6)
    model = nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16), shared, nn.Linear(16, 16), shared, OwnNorm(16))
    model = model.to(device)
    originals, keys, params = list(model), model.state_dict().keys(), list(model.parameters())
    x = torch.randn(4, 16, device=device)
    want = model(x)
    other = nn.Sequential(nn.LayerNorm(16), nn.RMSNorm(16))   # another model in the process: left as it is
    handle = ops.apply_to(model)
    assert type(other[0]) is nn.LayerNorm and type(other[1]) is nn.RMSNorm and type(nn.LayerNorm(4)) is nn.LayerNorm
    assert type(model[1]) is LayerNorm and type(model[2]) is RMSNorm and model[2] is model[4]
    assert model[1].weight is originals[1].weight and model[2].weight is shared.weight
    assert model.state_dict().keys() == keys and list(model.parameters()) == params
    assert (m := compare(model(x), want, torch.float32, reduction=16)) is None, m
    assert [r[0] for r in handle.report.replaced] == ["1", "2"]   # the shared norm once, by its first name
    assert handle.report.skipped == [("5", "OwnNorm", "a class this library does not know")]
    handle.remove()
    assert list(model) == originals
    with ops.apply_to(model) as again:
        assert type(model[1]) is LayerNorm and "replaced 2" in str(again.report)
    assert list(model) == originals
    untouched = ops.apply_to(model, norms=False)
    assert list(model) == originals and not untouched.report.replaced
    with pytest.raises(TypeError, match="^model:"):
        ops.apply_to("not a model")


def _tiny(family: str) -> nn.Module:
    """A two-layer random model of ``family`` from its config (seed 0), float32, eval mode."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    common = {"vocab_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4}
    if family == "gpt2":
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4,
                                                                    vocab_size=128)).eval()
    if family == "opt":
        return transformers.OPTForCausalLM(transformers.OPTConfig(hidden_size=64, ffn_dim=128,
                                                                  word_embed_proj_dim=64, **common)).eval()
    if family == "bert":
        return transformers.BertForMaskedLM(transformers.BertConfig(hidden_size=64, intermediate_size=128,
                                                                    **common)).eval()
    if family == "vit":
        return transformers.ViTForImageClassification(transformers.ViTConfig(
            hidden_size=64, intermediate_size=128, image_size=32, patch_size=8, num_labels=128,
            **{k: v for k, v in common.items() if k != "vocab_size"})).eval()
    config = getattr(transformers, f"{family}Config")(hidden_size=64, intermediate_size=128, num_key_value_heads=2,
                                                      head_dim=16, **common)
    return getattr(transformers, f"{family}ForCausalLM")(config).eval()


def _digest_known(model: nn.Module) -> bool:
    """Whether the installed transformers' blocks read as the ones apply_to's fusion of this family reproduces."""
    from ops.hf_blocks import FUSIONS

    for block in model.modules():
        fusions = loaded_class_entry(block, FUSIONS)
        if fusions is not None:
            return all("forward is not" not in fusion.why_not(block) for fusion in fusions)
    return False


def _inputs(family: str, device: str) -> torch.Tensor:
    """A batch of two for ``_tiny(family)``: 8 token ids, or ViT's 32x32 images."""
    if family == "vit":
        return torch.randn(2, 3, 32, 32, device=device)
    return torch.randint(0, 128, (2, 8), device=device)


def logits_and_grads(model: nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The model's logits and every parameter's gradient of their mean square."""
    model.zero_grad()
    logits = model(ids).logits
    logits.float().square().mean().backward()
    return logits.detach(), [p.grad.clone() for p in model.parameters()]


def assert_same_logits_and_grads(model: nn.Module, got: tuple[torch.Tensor, list[torch.Tensor]],
                                 want: tuple[torch.Tensor, list[torch.Tensor]]) -> None:
    """float32 logits and each named parameter's gradient within the tolerance of a tiny model's reductions."""
    assert (m := compare(got[0], want[0], torch.float32, reduction=64)) is None, m
    for (name, _), g, w in zip(model.named_parameters(), got[1], want[1], strict=True):
        assert (m := compare(g, w, torch.float32, reduction=2 * 8 * 128, cond=4.0)) is None, f"{name}: {m}"


HF_CASES = {   # family: the classes its norms must become (semantics), one norm's qualified name, blocks fused
    "Llama": ({"RMSNorm(semantics='llama')"}, "model.layers.0.input_layernorm", 2),
    "Mistral": ({"RMSNorm(semantics='llama')"}, "model.layers.1.post_attention_layernorm", 2),
    "Qwen2": ({"RMSNorm(semantics='llama')"}, "model.norm", 2),
    "Qwen3": ({"RMSNorm(semantics='llama')"}, "model.layers.1.self_attn.k_norm", 2),
    "Gemma": ({"RMSNorm(semantics='gemma')"}, "model.norm", 0),
    "Olmo2": ({"RMSNorm(semantics='torch')"}, "model.layers.0.post_feedforward_layernorm", 0),
    "gpt2": ({"LayerNorm"}, "transformer.h.1.ln_2", 2),
    "opt": ({"LayerNorm"}, "model.decoder.final_layer_norm", 2),
    "vit": ({"LayerNorm"}, "vit.layers.1.layernorm_after", 2),
    "bert": ({"LayerNorm"}, "bert.encoder.layer.0.attention.output.LayerNorm", 4),
}


@pytest.mark.parametrize("family", list(HF_CASES))
def test_hugging_face_model_gives_its_own_logits_and_gradients(device: str, family: str) -> None:
    """A tiny Hugging Face model of each family: every norm replaced by the right class and semantics (none
    skipped), its blocks fused as ``FUSIONS`` says (a residual add and its norm; GPT-2's MLP norm, c_fc and GELU),
    the same state dict, logits and every parameter's gradient as the unpatched model's (float32), and remove() gives
    the unpatched model back (no forward of ours)."""
    model = _tiny(family).to(device)
    ids = _inputs(family, device)
    want = logits_and_grads(model, ids)
    keys = model.state_dict().keys()
    classes, one, fused = HF_CASES[family]
    if fused and not _digest_known(model):   # a transformers whose layer forward changed: reported, not fused
        fused = 0
    with ops.apply_to(model) as handle:
        assert {word for _, _, word in handle.report.replaced} == classes and len(handle.report.fused) == fused
        assert all("forward" in why for _, _, why in handle.report.skipped), handle.report.skipped
        assert one in {name for name, _, _ in handle.report.replaced}
        assert model.state_dict().keys() == keys
        assert_same_logits_and_grads(model, logits_and_grads(model, ids), want)
    assert not any(isinstance(m, (LayerNorm, RMSNorm)) or "forward" in vars(m) for m in model.modules())


def test_generate_checkpointing_and_checkpoints_work_as_before(tmp_path: object) -> None:
    """On a patched tiny Llama (CPU): greedy ``generate()`` with its KV cache gives the unpatched model's tokens;
    gradient checkpointing gives the same gradients; an optimizer made before the patch trains the same parameters;
    ``save_pretrained`` of the patched model loads into an unpatched one with the same logits."""
    transformers = pytest.importorskip("transformers")
    model = _tiny("Llama")
    ids = torch.randint(0, 128, (1, 5))
    want_tokens = model.generate(ids, max_new_tokens=6, do_sample=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    handle = ops.apply_to(model)
    assert torch.equal(model.generate(ids, max_new_tokens=6, do_sample=False), want_tokens)
    model.train()
    grads = []
    for checkpointing in (False, True):
        if checkpointing:   # activation_checkpointing_enable from transformers 5.2x, the older name before
            (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
        model.zero_grad()
        model(ids).logits.square().mean().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for g, w in zip(*grads, strict=True):
        torch.testing.assert_close(g, w)
    norm = model.model.norm
    before = norm.weight.detach().clone()
    opt.step()   # made before apply_to: it holds the norm's parameter itself
    assert not torch.equal(norm.weight, before)
    model.eval()
    model.save_pretrained(tmp_path)
    plain = transformers.LlamaForCausalLM.from_pretrained(tmp_path).eval()
    assert not any(isinstance(m, RMSNorm) for m in plain.modules())
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, plain(ids).logits, rtol=1e-4, atol=1e-4)
    handle.remove()


def test_compiled_patched_model_gives_the_same_logits() -> None:
    """torch.compile(fullgraph=True) of a patched tiny Qwen3 (CPU; our norms are custom ops with fakes, traced into the
    one graph): the eager patched model's logits."""
    model = _tiny("Qwen3")
    ids = torch.randint(0, 128, (2, 8))
    with ops.apply_to(model), torch.no_grad():
        want = model(ids).logits
        got = torch.compile(model, fullgraph=True)(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_fused_layer_takes_positional_arguments_and_skips_a_forward_it_does_not_know() -> None:
    """A fused Llama layer called with its arguments by position gives the unfused layer's output; a subclass whose
    forward differs is not fused, and the report says why."""
    transformers = pytest.importorskip("transformers")
    model = _tiny("Llama")
    if not _digest_known(model):
        pytest.skip("this transformers' LlamaDecoderLayer.forward is not the one the fusion reproduces")
    layer = model.model.layers[0]
    h = torch.randn(1, 5, 64)
    position_ids = torch.arange(5)[None]
    rope = model.model.rotary_emb(h, position_ids=position_ids)
    with torch.no_grad():
        want = layer(h, None, position_ids, None, False, rope)
        with ops.apply_to(model) as handle:
            assert "forward" in vars(layer) and handle.report.fused[0][0] == "model.layers.0"
            got = layer(h, None, position_ids, None, False, rope)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)

    class OwnLayer(transformers.models.llama.modeling_llama.LlamaDecoderLayer):
        def forward(self, hidden_states: torch.Tensor, **kwargs: object) -> torch.Tensor:
            return hidden_states

    model.model.layers[1] = OwnLayer(model.config, 1)
    with ops.apply_to(model) as handle:
        assert ("model.layers.1", "OwnLayer", "its forward is not the one the fusion knows") in handle.report.skipped
        assert [name for name, _, _ in handle.report.fused] == ["model.layers.0"]


@pytest.mark.parametrize("family", ["Llama", "Gemma", "gpt2", "opt", "vit", "bert"])
def test_training_converges_as_the_unpatched_model(family: str) -> None:
    """Liger-Kernel's convergence check, small: 100 AdamW steps of a tiny model on fixed data (CPU, float32) from one
    seed, patched and unpatched; the patched loss curve stays within the unpatched model's own seed-to-seed spread
    (the largest gap between two seeds' curves, each step), and ends where it ends (ViT: a class per image)."""
    def curve(seed: int, patched: bool) -> torch.Tensor:
        model = _tiny(family).train()
        torch.manual_seed(seed)
        with torch.no_grad():   # the seed's own matrices (the config's init drew seed 0's)
            for p in model.parameters():
                if p.dim() > 1:
                    p.normal_(0.0, 0.05)
        handle = ops.apply_to(model) if patched else None
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        data = torch.Generator().manual_seed(1234)
        ids = torch.randint(0, 128, (4, 16), generator=data)
        batch = ({"pixel_values": torch.randn(4, 3, 32, 32, generator=data), "labels": ids[:, 0]} if family == "vit"
                 else {"input_ids": ids, "labels": ids})
        losses = []
        for _ in range(100):
            loss = model(**batch).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        if handle is not None:
            handle.remove()
        return torch.tensor(losses)

    base, other, ours = curve(0, False), curve(1, False), curve(0, True)
    spread = (base - other).abs().max()
    assert (ours - base).abs().max() <= spread, ((ours - base).abs().max(), spread)
    assert ours[-1] < 0.5 * ours[0]   # it learned the fixed batch


class Adapted(nn.Module):
    """A module put in place of a projection after the patch, as a PEFT LoRA adapter is: the projection plus a
    low-rank term."""

    def __init__(self, base: nn.Module, k: int, n: int) -> None:
        super().__init__()
        like = {"device": base.weight.device, "dtype": base.weight.dtype}
        self.base, self.down, self.up = base, nn.Linear(k, 2, bias=False, **like), nn.Linear(2, n, bias=False, **like)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.up(self.down(x))


PROJECTION_CASES = {   # family: its blocks, the fused projection in a block, its (in, out), the fusion's words
    "gpt2": ("transformer.h", "mlp.c_fc", (64, 256), "ln_2 + mlp.c_fc + GELU"),
    "vit": ("vit.layers", "mlp.fc1", (64, 128), "layernorm_after + mlp.fc1 + activation"),
    "opt": ("model.decoder.layers", "fc1", (64, 128), "final_layer_norm + fc1 + activation"),
}


@pytest.mark.parametrize("family", list(PROJECTION_CASES))
def test_fused_projection_runs_unfused_once_it_is_adapted(family: str) -> None:
    """A pre-norm MLP's norm, first projection and activation fused as one op give the unpatched logits; an adapter
    put in place of the projection afterwards (as PEFT does) is run, through the unfused modules, with the same
    logits as the unpatched model with it; a block whose projection was adapted before gets the residual fusion where
    the family has one, or none (reported); ``projections=False`` gives the residual fusion."""
    model = _tiny(family)
    if not _digest_known(model):
        pytest.skip(f"the installed transformers' {family} block is not the one the fusion knows")
    blocks, proj, (k, n), what = PROJECTION_CASES[family]
    ids = _inputs(family, "cpu")
    before = _tiny(family)
    block0 = before.get_submodule(f"{blocks}.0")
    block0.set_submodule(proj, Adapted(block0.get_submodule(proj), k, n))
    with ops.apply_to(before) as handle:
        fused = {name: words for name, _, words in handle.report.fused}
        assert fused[f"{blocks}.1"] == what
        assert (fused.get(f"{blocks}.0", "").startswith("residual add") if family != "gpt2" else
                [why for name, _, why in handle.report.skipped if name == f"{blocks}.0"]
                == [f"its {proj} is Adapted, not a projection the fusion reads"])
    with ops.apply_to(_tiny(family), projections=False) as handle:
        assert all(words.startswith("residual add") for _, _, words in handle.report.fused)
    with torch.no_grad():
        want = model(ids).logits
        handle = ops.apply_to(model)
        assert [words for _, _, words in handle.report.fused] == [what] * 2
        fused = model(ids).logits
        assert (m := compare(fused, want, torch.float32, reduction=64)) is None, m
        block1 = model.get_submodule(f"{blocks}.1")
        block1.set_submodule(proj, Adapted(block1.get_submodule(proj), k, n))
        nn.init.normal_(block1.get_submodule(proj).up.weight)
        got = model(ids).logits
        handle.remove()
        want = model(ids).logits
    assert (m := compare(got, want, torch.float32, reduction=64)) is None, m
    assert (got - fused).abs().max() > 1e-3   # the adapter was run


@pytest.mark.parametrize("order", ["adapter_first", "patch_first"])
def test_peft_lora_adapters_are_run_before_or_after_the_patch(order: str) -> None:
    """PEFT LoRA adapters on GPT-2's c_fc (its fused projection) and on a tiny Llama's q_proj/v_proj, added before or
    after apply_to: the patched model gives the unpatched adapted model's logits and the adapters' gradients, and
    GPT-2's MLP with an adapter on c_fc is never run fused without it."""
    peft = pytest.importorskip("peft")
    for family, targets, fan_in_fan_out in (("gpt2", ["c_fc"], True), ("Llama", ["q_proj", "v_proj"], False)):
        model = _tiny(family)
        ids = _inputs(family, "cpu")
        config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, fan_in_fan_out=fan_in_fan_out,
                                 init_lora_weights=False)
        handle = ops.apply_to(model) if order == "patch_first" else None
        model = peft.get_peft_model(model, config)
        if handle is None:
            handle = ops.apply_to(model)
            if family == "gpt2":
                assert not handle.report.fused and len(handle.report.skipped) == 2, handle.report

        def run(model: nn.Module = model, ids: torch.Tensor = ids) -> tuple[torch.Tensor, list[torch.Tensor]]:
            model.zero_grad()
            logits = model(ids).logits
            logits.square().mean().backward()
            return logits.detach(), [p.grad.clone() for p in model.parameters() if p.requires_grad]

        got, got_grads = run()
        handle.remove()
        want, want_grads = run()
        assert (m := compare(got, want, torch.float32, reduction=64)) is None, f"{family}: {m}"
        assert len(got_grads) == 2 * len(targets) * 2   # lora_A and lora_B of each target in each of two layers
        for g, w in zip(got_grads, want_grads, strict=True):
            assert (m := compare(g, w, torch.float32, reduction=2 * 8 * 128, cond=4.0)) is None, f"{family}: {m}"


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["Llama", "gpt2", "vit", "opt", "bert"])
def test_gpu_cuda_graph_of_a_patched_model(family: str) -> None:
    """A patched tiny model's bf16 inference forward captured by ``torch.cuda.graph`` and replayed on new input gives
    the patched model's eager logits for that input (our fused ops under capture, as in the model's own graph)."""
    from ops.bench.timing import captured

    model = _tiny(family).to("cuda", torch.bfloat16)
    ids = _inputs(family, "cuda")
    ids = ids.to(torch.bfloat16) if ids.is_floating_point() else ids
    with ops.apply_to(model) as handle, torch.no_grad():
        assert handle.report.fused or not _digest_known(model)
        kwargs = {"use_cache": False} if family in ("Llama", "gpt2", "opt") else {}   # no KV cache to grow
        graph, out = captured(lambda: model(ids, **kwargs).logits, warmup=2)
        fresh = _inputs(family, "cuda")
        ids.copy_(fresh.to(ids.dtype))
        graph.replay()
        want = model(ids, **kwargs).logits
    assert (m := compare(out, want, torch.bfloat16, reduction=64)) is None, m


SHARED_FUSED = {"Llama": 4, "Mistral": 4, "Qwen2": 4, "Qwen3": 4, "vit": 2, "opt": 2, "bert": 2}   # two layers'


@pytest.mark.parametrize("family", list(SHARED_FUSED))
def test_shared_input_projections_give_the_unpatched_logits_and_gradients(device: str, family: str,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """With SHARED_INPUT_PROJECTIONS on: each attention's q/k/v (and a gated MLP's gate/up) as one ``linears`` give
    the unpatched logits and every gradient; an adapter put in place of one projection afterwards is run (that
    block falls back to its own forward)."""
    from ops import hf_blocks

    monkeypatch.setattr(hf_blocks, "SHARED_INPUT_PROJECTIONS", True)
    model, ids = _tiny(family).to(device), _inputs(family, device)
    want = logits_and_grads(model, ids)
    with ops.apply_to(model) as handle:
        shared = [(name, what) for name, _, what in handle.report.fused if what.endswith("as one linears")]
        assert len(shared) == SHARED_FUSED[family], handle.report
        got = logits_and_grads(model, ids)
        assert_same_logits_and_grads(model, got, want)
        logits = got[0]
        block = model.get_submodule(shared[0][0])
        first = next(n for n, m in block.named_children() if isinstance(m, nn.Linear))
        block.set_submodule(first, Adapted(block.get_submodule(first), 64, block.get_submodule(first).out_features))
        nn.init.normal_(block.get_submodule(first).up.weight, std=10.0)   # post-norm BERT damps a small one
        with torch.no_grad():
            adapted = model(ids).logits
    with torch.no_grad():
        plain = model(ids).logits
    assert (m := compare(adapted, plain, torch.float32, reduction=64)) is None, m
    assert (adapted - logits).abs().max() > 1e-3   # the adapter was run
