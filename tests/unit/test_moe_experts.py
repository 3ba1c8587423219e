"""The routed experts of the Nemotron-H MoE: one stacked copy of their weights,
and the grouped and gathered paths against the per-expert loop they replace."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from models.host_reads import count_host_reads
from models.kernels import cpu_build, dispatch
from models.layers import moe_experts
from models.layers.moe import NemotronHMoE
from models.layers.relu2_mlp import Relu2MLP
from tests.unit.test_moe import HIDDEN, moe_config, random_moe

# The routed experts alone, each way the layer can run them.
PATHS: dict[str, Callable[..., torch.Tensor]] = {
    "grouped": dispatch.moe_experts,
    "gathered": moe_experts.routed_gathered,
}


def expert(moe: NemotronHMoE, e: int) -> Relu2MLP:
    module = moe.experts[e]
    assert isinstance(module, Relu2MLP)
    return module


def reference(moe: NemotronHMoE, x: torch.Tensor) -> torch.Tensor:
    """The layer as it ran before its weights were stacked: the loop over the
    chosen experts' own layers, then the shared expert's own layers."""
    experts, weights = moe.gate(x)
    out = moe_experts.routed_by_expert_loop(x, experts, weights, moe.experts).to(x.dtype)
    if moe.shared_experts is not None:
        out = out + moe.shared_experts(x)
    return out


def test_expert_weights_are_views_of_one_stack() -> None:
    moe = random_moe(moe_config())
    for e in range(len(moe.experts)):
        assert expert(moe, e).up_proj.weight.data_ptr() == moe.up_weights[e].data_ptr()
        assert expert(moe, e).down_proj.weight.data_ptr() == moe.down_weights[e].data_ptr()
    routed = [p for name, p in moe.named_parameters() if name.startswith("experts.")]
    # Every routed expert's parameters live in the two stacks: one copy.
    assert {p.untyped_storage().data_ptr() for p in routed} == {
        moe.up_weights.untyped_storage().data_ptr(),
        moe.down_weights.untyped_storage().data_ptr(),
    }
    stacked_bytes = moe.up_weights.untyped_storage().nbytes() * 2
    assert stacked_bytes == sum(p.nbytes for p in routed)
    names = set(moe.state_dict())
    assert {"experts.0.up_proj.weight", "experts.7.down_proj.weight"} <= names
    assert not any("up_weights" in name or "down_weights" in name for name in names)


def test_loading_by_checkpoint_name_fills_the_stack() -> None:
    config = moe_config()
    moe = random_moe(config, seed=1)
    source = random_moe(config, seed=2)
    moe.load_state_dict(source.state_dict())
    stacked = torch.stack([expert(source, e).up_proj.weight for e in range(config.num_experts)])
    assert torch.equal(moe.up_weights, stacked)
    x = torch.randn(6, HIDDEN)
    with torch.no_grad():
        torch.testing.assert_close(moe(x), reference(source, x), rtol=1e-5, atol=1e-5)


def test_casting_stacks_the_weights_again() -> None:
    moe = random_moe(moe_config())
    before = expert(moe, 3).up_proj.weight.detach().clone()
    moe.to(torch.bfloat16)
    assert moe.up_weights.dtype == torch.bfloat16
    assert expert(moe, 3).up_proj.weight.data_ptr() == moe.up_weights[3].data_ptr()
    assert torch.equal(moe.up_weights[3], before.bfloat16())
    moe.float()
    assert expert(moe, 5).down_proj.weight.data_ptr() == moe.down_weights[5].data_ptr()


@pytest.mark.parametrize("cpu_kernels", ["1", "0"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shared", [40, 0])
# decode sizes; a prefill past the experts' kernel's rows (8 experts, top-2)
@pytest.mark.parametrize("tokens", [1, 8, 400])
@pytest.mark.parametrize("sync_free", [False, True])
def test_layer_equals_the_per_expert_loop(
    kernel_switch: Callable[[str, str | None], None],
    cpu_kernels: str,
    dtype: torch.dtype,
    shared: int,
    tokens: int,
    sync_free: bool,
) -> None:
    kernel_switch(cpu_build.ENABLE_ENV, cpu_kernels)
    moe = random_moe(moe_config(shared_intermediate_size=shared), seed=tokens).to(dtype)
    x = torch.randn(tokens, HIDDEN).to(dtype)
    with torch.no_grad():
        got = moe(x, sync_free=sync_free)
        want = reference(moe, x)
    assert got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


@pytest.mark.parametrize("sync_free", [False, True])
def test_a_shared_expert_with_a_bias_runs_on_its_own_layers(sync_free: bool) -> None:
    """The kernel takes no biases: with `mlp_bias` the shared expert runs
    its own layers beside the routed experts' call."""
    config = moe_config()
    torch.manual_seed(4)
    moe = NemotronHMoE(HIDDEN, config, shared_bias=True)
    with torch.no_grad():
        for param in moe.parameters():
            param.copy_(torch.randn_like(param) * 0.3)
        x = torch.randn(6, HIDDEN)
        got = moe(x, sync_free=sync_free)
    # The reference runs the shared expert's own layers, bias included.
    torch.testing.assert_close(got, reference(moe, x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cpu_kernels", ["1", "0"])
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("tokens", [1, 3])
def test_a_decode_step_reads_only_the_chosen_experts(
    kernel_switch: Callable[[str, str | None], None], cpu_kernels: str, path: str, tokens: int
) -> None:
    """Every expert no token chose has NaN weights: the routed sum stays
    finite. Running every expert weighted by the routing (zero for the
    unchosen) would not: NaN * 0 is NaN."""
    kernel_switch(cpu_build.ENABLE_ENV, cpu_kernels)
    config = moe_config(shared_intermediate_size=0)
    moe = random_moe(config)
    x = torch.randn(tokens, HIDDEN)
    with torch.no_grad():
        experts, weights = moe.gate(x)
        unchosen = sorted(set(range(config.num_experts)) - set(experts.flatten().tolist()))
        assert unchosen
        moe.up_weights[unchosen] = float("nan")
        moe.down_weights[unchosen] = float("nan")
        routed = PATHS[path](x, experts, weights, moe.up_weights, moe.down_weights)
        assert torch.isfinite(routed).all()
        every = sum(
            moe.experts[e](x) * (experts == e).float().mul(weights).sum(1, keepdim=True)
            for e in range(config.num_experts)
        )
        assert isinstance(every, torch.Tensor) and every.isnan().all()


def test_the_gathered_path_reads_nothing_back() -> None:
    moe = random_moe(moe_config())
    x = torch.randn(5, HIDDEN)
    with torch.no_grad():
        experts, weights = moe.gate(x)
        with count_host_reads("cpu") as gathered:
            moe_experts.routed_gathered(x, experts, weights, moe.up_weights, moe.down_weights)
        with count_host_reads("cpu") as loop:
            moe_experts.routed_by_expert_loop(x, experts, weights, moe.experts)
    assert gathered.count == 0, gathered.names
    assert loop.count > 2, loop.names  # unique, then one nonzero per chosen expert


@pytest.mark.parametrize(("cpu_kernels", "reads"), [("1", []), ("0", ["Tensor.tolist"])])
def test_the_grouped_path_reads_the_segments_once(
    kernel_switch: Callable[[str, str | None], None], cpu_kernels: str, reads: list[str]
) -> None:
    """The C kernel reads nothing back; its torch twin (as on a GPU) reads
    the segment bounds once, where the old loop read once per expert."""
    kernel_switch(cpu_build.ENABLE_ENV, cpu_kernels)
    moe = random_moe(moe_config())
    x = torch.randn(9, HIDDEN)
    with torch.no_grad():
        experts, weights = moe.gate(x)
        with count_host_reads("cpu") as counted:
            dispatch.moe_experts(x, experts, weights, moe.up_weights, moe.down_weights)
    assert counted.names == reads


def test_gathered_slices_of_pairs_add_up(monkeypatch: pytest.MonkeyPatch) -> None:
    moe = random_moe(moe_config())
    x = torch.randn(7, HIDDEN)
    pair_bytes = (moe.up_weights[0].numel() + moe.down_weights[0].numel()) * 4
    with torch.no_grad():
        experts, weights = moe.gate(x)
        whole = moe_experts.routed_gathered(x, experts, weights, moe.up_weights, moe.down_weights)
        monkeypatch.setattr(moe_experts, "GATHER_BYTES", 3 * pair_bytes)
        sliced = moe_experts.routed_gathered(x, experts, weights, moe.up_weights, moe.down_weights)
    torch.testing.assert_close(sliced, whole, rtol=1e-6, atol=1e-6)
