"""Drop-in modules (CPU, and the GPU where present): ``LayerNorm`` and ``FusedLayerNormLinear`` as torch's modules
are, and ``from_torch``: state dicts, every constructor option, children changed as an ``nn.Sequential``'s, shared
parameters, hooks, parametrizations, copies and conversions, inference mode and frozen parameters."""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import torch.nn.utils.parametrizations
import torch.nn.utils.prune
from drop_in_helpers import compare_to_scale, dtypes, leaves, pair, step
from torch import nn

from ops import layernorm as L
from ops import layernorm_linear as LL
from ops.tolerance import compare


@pytest.mark.parametrize("shape", [(7,), (5, 8), (2, 3, 4)])
@pytest.mark.parametrize("affine,bias", [(True, True), (True, False), (False, False)])
def test_layernorm_module_matches_torch(device: str, shape: tuple[int, ...], affine: bool, bias: bool) -> None:
    theirs = nn.LayerNorm(shape, elementwise_affine=affine, bias=bias, device=device)
    for p in theirs.parameters():
        nn.init.normal_(p)
    ours = L.LayerNorm.from_torch(copy.deepcopy(theirs))   # from_torch shares; theirs is the float64 reference
    assert ours.state_dict().keys() == theirs.state_dict().keys()
    x = torch.randn(3, *shape, device=device)
    mine, ref = leaves(x), leaves(x.double())
    y, want = ours(*mine), theirs.double()(*ref)
    dy = torch.randn_like(want)
    y.backward(dy.float())
    want.backward(dy)
    assert (m := compare(y, want, torch.float32, reduction=4)) is None, m
    assert (m := compare(mine[0].grad, ref[0].grad, torch.float32, reduction=64)) is None, m
    for p, q in zip(ours.parameters(), theirs.parameters(), strict=True):
        assert p.grad.dtype == torch.float32 and (m := compare(p.grad, q.grad, torch.float32, reduction=64)) is None, m


@pytest.mark.parametrize("affine,norm_bias,bias", [(a, nb, b) for a in (True, False) for nb in (True, False)
                                                   for b in (True, False) if a or not nb])
@pytest.mark.parametrize("shape", [(24,), (3, 24)])
def test_fused_module_from_torch_every_combination(device: str, affine: bool, norm_bias: bool, bias: bool,
                                                   shape: tuple[int, ...]) -> None:
    seq = nn.Sequential(nn.LayerNorm(shape, elementwise_affine=affine, bias=norm_bias),
                        nn.Linear(24, 10, bias=bias)).to(device)
    for p in seq.parameters():
        nn.init.normal_(p)
    ours = LL.FusedLayerNormLinear.from_torch(copy.deepcopy(seq))   # its own parameters, for their own gradients
    x = torch.randn(4, *shape, device=device)
    mine, theirs = leaves(x), leaves(x)
    y, want = ours(*mine), seq(*theirs)
    y.sum().backward()
    want.sum().backward()
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(mine[0].grad, theirs[0].grad, rtol=1e-5, atol=1e-4)
    for (name, p), q in zip(ours.named_parameters(), seq.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-3, msg=name)


class _Doubled(nn.Module):
    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return 2 * w


def _swap_weight(how: str, module: nn.Module, weight: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """A call of ``module`` that must use ``weight`` in place of ``module[1].weight`` (or the LayerNorm's own),
    swapped in ``how`` torch lets a user do it."""
    target = module[1] if isinstance(module, nn.Sequential) else module
    name = "1.weight" if isinstance(module, nn.Sequential) else "weight"
    if how == "functional_call":
        return lambda x: torch.func.functional_call(module, {name: weight}, (x,))
    if how == "parametrize":   # the parameter moves out of _parameters; the class gets a property
        with torch.no_grad():
            target.weight.copy_(weight / 2)
        torch.nn.utils.parametrize.register_parametrization(target, "weight", _Doubled())
    elif how == "plain attribute":   # deleted, then a plain tensor in the instance's __dict__
        del target.weight
        target.weight = weight
    elif how == "subclass":   # a subclass that answers .weight itself
        target.__class__ = type("Sub", (type(target),), {"weight": property(lambda self: weight)})
    return module


@pytest.mark.parametrize("how", ["functional_call", "parametrize", "plain attribute", "subclass"])
@pytest.mark.parametrize("kind", ["layernorm", "layernorm_linear"])
def test_module_forward_uses_swapped_weight(device: str, how: str, kind: str) -> None:
    """The forwards read parameters from ``_parameters`` where that is safe (``common.weight_and_bias``); a weight
    swapped in any other way torch allows is the one used."""
    if kind == "layernorm":
        module = L.LayerNorm(24, device=device)
        weight = torch.randn(24, device=device)
    else:
        module = LL.FusedLayerNormLinear(24, 10, device=device)
        weight = torch.randn(10, 24, device=device)
    x = torch.randn(5, 24, device=device)
    with torch.no_grad():
        nn.init.normal_(module.bias if kind == "layernorm" else module[1].bias)
        y = _swap_weight(how, module, weight)(x)
    if kind == "layernorm":
        want = F.layer_norm(x.double(), (24,), weight.double(), module.bias.double())
    else:
        want = F.linear(F.layer_norm(x.double(), (24,)), weight.double(), module[1].bias.double())
    assert (m := compare(y, want, torch.float32, reduction=24)) is None, m


class _LowRank(nn.Module):
    """A LoRA-style Linear put in the fused module's place: base(x) + B(A(x)), A and B constant-initialised."""

    def __init__(self, base: nn.Linear) -> None:
        super().__init__()
        self.base = base
        self.A = nn.Linear(base.in_features, 2, bias=False, device=base.weight.device, dtype=base.weight.dtype)
        self.B = nn.Linear(2, base.out_features, bias=False, device=base.weight.device, dtype=base.weight.dtype)
        nn.init.constant_(self.A.weight, 0.1)
        nn.init.constant_(self.B.weight, -0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.B(self.A(x))


def _plus_one(forward: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    return forward(x) + 1


_CHILD_CHANGES: dict[str, Callable[[nn.Sequential], object]] = {
    "forward hook": lambda m: m[1].register_forward_hook(lambda mod, inp, out: out * 2),
    "pre-hook on the LayerNorm": lambda m: m[0].register_forward_pre_hook(lambda mod, inp: (inp[0].flip(-1),)),
    "pruned": lambda m: torch.nn.utils.prune.l1_unstructured(m[1], "weight", amount=0.5),
    "replaced": lambda m: m.__setitem__(1, _LowRank(m[1])),
    "patched forward": lambda m: setattr(m[1], "forward", functools.partial(_plus_one, m[1].forward)),
    "our LayerNorm": lambda m: m.__setitem__(0, L.LayerNorm.from_torch(m[0])),
    "appended": lambda m: m.append(nn.GELU()),
    "extended in place": lambda m: m.__iadd__(nn.Sequential(nn.Tanh(), nn.Linear(5, 3).to(m[1].weight))),
    "inserted": lambda m: m.insert(1, nn.Hardtanh(-0.5, 0.5)),
    "deleted": lambda m: m.__delitem__(1),
    "popped": lambda m: m.pop(0),
}


@pytest.mark.parametrize("change", list(_CHILD_CHANGES))
def test_fused_module_children_run_as_in_sequential(device: str, change: str) -> None:
    """``FusedLayerNormLinear`` is an ``nn.Sequential``: a child hooked (pruning's hook too), replaced (LoRA),
    given a patched forward (accelerate's offload) or subclassed, and children added or removed, run as
    ``nn.Sequential`` runs them, with the float64 torch model's outputs and gradients; after an update of what a
    hook computes the weight from (pruning's weight_orig), the next call sees it (never a weight of an earlier
    call). Global module hooks see the children called, as for torch's model. Plain children keep the fused
    call."""
    torch.manual_seed(0)
    seq = nn.Sequential(nn.LayerNorm(12), nn.Linear(12, 5)).to(device)
    with torch.no_grad():
        for p in seq.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    ref = copy.deepcopy(seq)
    ours = LL.FusedLayerNormLinear.from_torch(seq)
    torch.manual_seed(1)
    _CHILD_CHANGES[change](ours)
    torch.manual_seed(1)
    _CHILD_CHANGES[change](ref)
    ref.double()
    x = torch.randn(9, 12, device=device)
    for _ in range(2):
        ours.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        _check_step(step(ours, x), step(ref, x.double()), torch.float32)
        if change == "pruned":
            for model in (ours, ref):
                with torch.no_grad():
                    model[1].weight_orig.mul_(-1.5)
    seen: list[str] = []
    handle = torch.nn.modules.module.register_module_forward_hook(
        lambda mod, inp, out: seen.append(type(mod).__name__))
    try:
        want = step(ref, x.double())
        torchs = list(seen)
        seen.clear()
        _check_step(step(ours, x), want, torch.float32)
    finally:
        handle.remove()
    assert seen[:-1] == torchs[:-1] and seen[-1] == "FusedLayerNormLinear", (seen, torchs)
    plain = LL.FusedLayerNormLinear.from_torch(nn.Sequential(nn.LayerNorm(12), nn.Linear(12, 5)))
    assert LL.module.runs_as_its_class(plain[0], plain[1])


@pytest.mark.parametrize("change", ["forward hook", "weight_norm", "pruned"])
def test_fused_module_from_torch_keeps_what_the_children_do(device: str, change: str) -> None:
    """``from_torch`` of a Sequential whose children are more than plain modules takes the children themselves
    (hooks, parametrizations, pruning): ours computes the source's outputs and gradients (float64 torch model), and
    a change to them (pruning's ``weight_orig``) is seen by the next call. Before: load_state_dict's raw error for
    each, or hooks dropped silently. Our LayerNorm's ``from_torch`` names a parametrized source."""
    torch.manual_seed(0)
    seq = nn.Sequential(nn.LayerNorm(12), nn.Linear(12, 5)).to(device)
    changes = {"weight_norm": lambda m: torch.nn.utils.parametrizations.weight_norm(m[1]),
               **{name: _CHILD_CHANGES[name] for name in ("forward hook", "pruned")}}
    ref = copy.deepcopy(seq).double()   # changed alike (torch cannot deep-copy a pruned module)
    for m in (seq, ref):
        changes[change](m)
    ours = LL.FusedLayerNormLinear.from_torch(seq)
    assert ours[0] is seq[0] and ours[1] is seq[1]
    x = torch.randn(9, 12, device=device)
    for _ in range(2):
        _check_step(step(ours, x), step(ref, x.double()), torch.float32)
        for model in (ours, ref):
            model.zero_grad(set_to_none=True)
            if change == "pruned":
                with torch.no_grad():
                    model[1].weight_orig.mul_(-1.5)
    if change == "weight_norm":   # our LayerNorm's from_torch takes a plain LayerNorm only
        torch.nn.utils.parametrizations.weight_norm(seq[0], dim=None)
        with pytest.raises(TypeError, match=r"^ln: its state dict holds .*parametrized or pruned"):
            L.LayerNorm.from_torch(seq[0])


class _TiedModel(nn.Module):
    """An embedding, a LayerNorm, and a LayerNorm+Linear head whose weight is the embedding's (tied, as GPT-2's)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.ln = nn.Embedding(20, 12), nn.LayerNorm(12)
        self.head = nn.Sequential(nn.LayerNorm(12), nn.Linear(12, 20, bias=False))
        self.head[1].weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.ln(self.emb(ids)))


def test_from_torch_shares_the_parameters(device: str) -> None:
    """``from_torch`` puts ours in place with the source's parameters themselves (as
    ``nn.SyncBatchNorm.convert_sync_batchnorm`` does): a head weight tied to the embedding stays tied, a frozen
    parameter stays frozen, and an optimizer made before the swap trains ours. Three SGD steps of the swapped model
    equal the float64 torch model's. Before (copies): the tie broken, the frozen bias trained, and the optimizer
    stepping parameters the model no longer used, all silently."""
    torch.manual_seed(0)
    model = _TiedModel().to(device)
    model.ln.bias.requires_grad_(False)
    ref = copy.deepcopy(model).double()
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.5), torch.optim.SGD(ref.parameters(), lr=0.5)
    model.ln, model.head = L.LayerNorm.from_torch(model.ln), LL.FusedLayerNormLinear.from_torch(model.head)
    assert model.head[1].weight is model.emb.weight and not model.ln.bias.requires_grad
    ids = torch.randint(0, 20, (3, 7), device=device)
    for _ in range(3):
        for m, o in ((model, opt), (ref, ref_opt)):
            o.zero_grad()
            m(ids).square().mean().backward()
            o.step()
        for (name, a), b in zip(model.named_parameters(), ref.parameters(), strict=True):
            assert (m := compare(a, b, torch.float32, reduction=64)) is None, f"{name}: {m}"
    frozen = nn.LayerNorm(12, device=device)   # parameters made buffers (constants): ours holds the same buffers
    weight = frozen.weight.detach() * 2
    del frozen.weight
    frozen.register_buffer("weight", weight)
    ours = L.LayerNorm.from_torch(frozen)
    assert ours.weight is weight and "weight" in dict(ours.named_buffers())
    x = torch.randn(3, 12, device=device)
    assert compare(ours(x), copy.deepcopy(frozen).double()(x.double()), torch.float32) is None
    seq = nn.Sequential(ours, nn.Linear(12, 3, device=device))   # our LayerNorm child: an nn.LayerNorm on its tensors
    fused = LL.FusedLayerNormLinear.from_torch(seq)
    assert type(fused[0]) is nn.LayerNorm and fused[0].weight is weight and fused[1] is seq[1]
    assert compare(fused(x), copy.deepcopy(seq).double()(x.double()), torch.float32, reduction=12) is None


def test_fused_module_slices_are_sequentials(device: str) -> None:
    """Slicing gives ``nn.Sequential`` of the children, as slicing torch's model gives (not a fused module of a
    part of one), computing what torch's slices compute."""
    torch.manual_seed(0)
    seq = nn.Sequential(nn.LayerNorm(12), nn.Linear(12, 5)).to(device)
    ours = LL.FusedLayerNormLinear.from_torch(seq)
    x = torch.randn(9, 12, device=device)
    for idx in (slice(None, 1), slice(1, None), slice(None), slice(None, None, -1)):
        part, want = ours[idx], seq[idx]
        assert type(part) is nn.Sequential and [type(m) for m in part] == [type(m) for m in want]
        if idx.step is None:
            torch.testing.assert_close(part(x), want(x), rtol=1e-5, atol=1e-5)
    assert ours[-1] is ours[1] and type(ours[0]) is nn.LayerNorm


def test_layernorm_is_an_nn_layernorm() -> None:
    """Our LayerNorm is an ``nn.LayerNorm``: code that picks LayerNorms by type (the weight-decay groups of Hugging
    Face's Trainer: ``isinstance(module, nn.LayerNorm)``) finds the same parameters in our model as in torch's.
    ``reset_parameters`` (meta-device init) is torch's. ``from_torch`` of ours keeps its activation; the fused
    module's refuses a LayerNorm that has one."""
    theirs, ours = pair("cpu")

    def by_type(model: nn.Module) -> list[str]:
        return [f"{name}.{p}" for name, m in model.named_modules() if isinstance(m, nn.LayerNorm)
                for p, _ in m.named_parameters(recurse=False)]
    assert by_type(ours) == by_type(theirs) == ["0.0.weight", "0.0.bias", "2.weight", "2.bias"]
    deferred = L.LayerNorm(5, device="meta").to_empty(device="cpu")   # meta-device init, as FSDP's flows do it
    deferred.reset_parameters()
    assert torch.equal(deferred.weight, torch.ones(5)) and torch.equal(deferred.bias, torch.zeros(5))
    gelu = L.LayerNorm(5, activation="gelu")
    assert L.LayerNorm.from_torch(gelu).activation == "gelu"
    assert L.LayerNorm.from_torch(gelu, activation="none").activation == "none"
    with pytest.raises(TypeError, match="^seq: its LayerNorm applies activation='gelu'"):
        LL.FusedLayerNormLinear.from_torch(nn.Sequential(gelu, nn.Linear(5, 3)))


def test_hugging_face_gpt2_with_our_layernorms(device: str) -> None:
    """A Hugging Face GPT-2 (a small config, random weights) with every ``nn.LayerNorm`` swapped for ours by
    ``from_torch``: the same logits and gradients as the original, and the same weight-decay groups of its
    Trainer (``get_parameter_names`` leaves out ``nn.LayerNorm`` parameters by type). Skipped where
    ``transformers`` is not installed (CI installs only the project); the GPU machine has it."""
    transformers = pytest.importorskip("transformers")
    from transformers.trainer_pt_utils import get_parameter_names

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=32)
    theirs = transformers.GPT2LMHeadModel(config).to(device).eval()
    ours = copy.deepcopy(theirs)
    for module in list(ours.modules()):
        for name, child in list(module.named_children()):
            if type(child) is nn.LayerNorm:
                setattr(module, name, L.LayerNorm.from_torch(child))
    assert sum(type(m) is L.LayerNorm for m in ours.modules()) == 5   # two per block, and ln_f
    ids = torch.randint(0, 128, (2, 16), device=device)
    logits = [model(ids).logits for model in (ours, theirs)]
    torch.testing.assert_close(*logits, rtol=1e-4, atol=1e-4)
    for y in logits:
        y.square().mean().backward()
    for (name, a), b in zip(ours.named_parameters(), theirs.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-3, atol=1e-5, msg=name)
    assert get_parameter_names(ours, [nn.LayerNorm]) == get_parameter_names(theirs, [nn.LayerNorm])


def _check_step(got: list[torch.Tensor | None], want: list[torch.Tensor | None], dtype: torch.dtype) -> None:
    """``step``'s results against the float64 torch model's: the same gradients None, the rest within the table;
    gradients relative to their largest value (the table's bound is for O(1) results; these reach about 80, and
    where weight_norm's projection cancels, torch's own bf16 model missed the absolute bound: its worst error was
    0.026 of the largest value over 5 seeds, ad hoc on the CPU, against the 0.064 allowed here)."""
    assert [t is None for t in got] == [t is None for t in want], "which gradients exist"
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        if a is None:
            continue
        m = compare(a, b, dtype, reduction=4) if i == 0 else compare_to_scale(a, b, dtype, 16)
        assert m is None, f"result {i}: {m}"


def test_inference_mode_as_torch(device: str) -> None:
    """Under ``torch.inference_mode`` the modules answer as torch's: the float64 model's values within the table,
    inference tensors out, for a shape's first call and its later ones (on a GPU the C++ route takes the later
    ones). An inference tensor given to them with gradients to come gets the error torch's modules give."""
    for dtype in dtypes(device):
        theirs, ours = pair(device, dtype)
        ref = copy.deepcopy(theirs).double()
        for rows in (7, 7, 300, 300):
            with torch.inference_mode():
                x = torch.randn(rows, 12, device=device, dtype=dtype)
                y = ours(x)
            assert y.is_inference() and y.dtype == dtype
            assert (m := compare(y, ref(x.double()), dtype, reduction=12)) is None, m
        for model in (theirs, ours):
            with pytest.raises(RuntimeError, match="Inference tensors cannot be saved for backward"):
                model(x)


@pytest.mark.parametrize("frozen", [("0.0.weight", "0.0.bias"), ("0.1.weight",), ("0.1.weight", "0.1.bias", "2.bias"),
                                    ("all",)])
def test_frozen_parameters_get_no_gradient(device: str, frozen: tuple[str, ...]) -> None:
    """Parameters set to ``requires_grad_(False)`` (fine-tuning a part of a model) get no gradient, as in torch's
    model, and the others get the float64 model's, on every route; x's gradient too, twice over the same shape
    (on a GPU the C++ route takes the second call)."""
    for dtype in dtypes(device):
        theirs, ours = pair(device, dtype)
        for model in (theirs, ours):
            for name, p in model.named_parameters():
                p.requires_grad_(name not in frozen and frozen != ("all",))
        ref = copy.deepcopy(theirs).double()
        x = torch.randn(9, 12, device=device, dtype=dtype)
        want = step(ref, x.double())
        for _ in range(2):
            ours.zero_grad(set_to_none=True)
            _check_step(step(ours, x), want, dtype)


def test_parametrized_weights_train(device: str) -> None:
    """Weights computed by a parametrization at each call (``weight_norm`` on the Linear, a user's on the
    LayerNorm's gamma) get the float64 model's gradients back to the parametrization's own parameters, and an
    update of those is seen by the next call: never the weight of an earlier call."""
    from torch.nn.utils import parametrizations, parametrize

    for dtype in dtypes(device):
        theirs, ours = pair(device, dtype)
        for model in (theirs, ours):
            parametrizations.weight_norm(model[0][1])
            parametrize.register_parametrization(model[2], "weight", _Doubled())
        ours.load_state_dict(theirs.state_dict())
        x = torch.randn(9, 12, device=device, dtype=dtype)
        for _ in range(3):
            ref = copy.deepcopy(theirs).double()
            _check_step(step(ours, x), step(ref, x.double()), dtype)
            for model in (theirs, ours):
                with torch.no_grad():
                    model[0][1].parametrizations.weight.original0.mul_(1.5)
                    model[2].parametrizations.weight.original.add_(0.25)
                model.zero_grad(set_to_none=True)


def test_copies_saves_and_conversions_as_torch(device: str, tmp_path: Path) -> None:
    """``copy.deepcopy``, ``torch.save`` / ``torch.load`` and ``pickle`` give modules of our classes that compute
    what the originals do; ``.double()``, ``.half()``, ``.bfloat16()`` convert them as torch's modules convert,
    with the converted torch model's results."""
    import pickle

    theirs, ours = pair(device)
    x = torch.randn(9, 12, device=device)
    torch.save(ours, tmp_path / "ours.pt")
    copies = [copy.deepcopy(ours), torch.load(tmp_path / "ours.pt", weights_only=False),
              pickle.loads(pickle.dumps(ours))]
    want = ours(x)
    for c in copies:
        assert [type(m) for m in c] == [type(m) for m in ours]
        torch.testing.assert_close(c(x), want, rtol=0, atol=0)
    conversions = {torch.float64: nn.Module.double, torch.float16: nn.Module.half, torch.bfloat16: nn.Module.bfloat16}
    for dtype, convert in conversions.items():
        a, b = convert(copy.deepcopy(ours)), convert(copy.deepcopy(theirs))
        assert all(p.dtype == dtype for p in a.parameters())
        # float64 runs torch's ops (test_float64_is_torchs_answer); the table has no float64 row: float32's
        _check_step(step(a, x.to(dtype)), step(b.double(), x.double()),
                    torch.float32 if dtype == torch.float64 else dtype)


def test_module_hooks_see_what_torchs_see(device: str) -> None:
    """Forward pre-hooks, forward hooks and full backward hooks on our modules see the tensors they see on torch's:
    a pre-hook's replaced input is the one used, and the backward hook's gradients are the float64 model's."""
    theirs, ours = pair(device)
    ref = copy.deepcopy(theirs).double()
    seen: dict[str, list[tuple]] = {"ref": [], "ours": []}
    for key, model in (("ref", ref), ("ours", ours)):
        for i in (0, 2):
            model[i].register_forward_pre_hook(lambda m, inp: (inp[0] * 2,))
            model[i].register_forward_hook(lambda m, inp, out, key=key: seen[key].append(("out", out.detach())))
            model[i].register_full_backward_hook(
                lambda m, gin, gout, key=key: seen[key].append(("grad_in", gin[0].detach())))
    x = torch.randn(9, 12, device=device)
    _check_step(step(ours, x), step(ref, x.double()), torch.float32)
    assert [k for k, _ in seen["ours"]] == [k for k, _ in seen["ref"]] == ["out", "out", "grad_in", "grad_in"]
    for (_, a), (_, b) in zip(seen["ours"], seen["ref"], strict=True):
        assert (m := compare(a, b, torch.float32, reduction=64)) is None, m
