"""Section 5.4's dropout with masks drawn in bulk (dropout.py) where torch's CPU kernel draws them one by one."""

import pytest
import torch

from vaswani_tx.model import dropout as dropout_module
from vaswani_tx.model.dropout import Dropout, apply_dropout, keep_threshold


@pytest.fixture
def bulk(monkeypatch):
    """The bulk draws whatever this CPU is (on an Intel CPU the model takes torch's own dropout)."""
    monkeypatch.setattr(dropout_module, "torch_draws_one_at_a_time", lambda: True)


def test_the_threshold_keeps_one_minus_p_of_the_int32_values():
    for p in (0.1, 0.3, 0.5, 1e-9, 0.999):
        kept = 2**31 - keep_threshold(p)  # int32 values >= the threshold
        assert abs(kept / 2**32 - (1 - p)) <= 2**-32
    assert keep_threshold(0.5) == 0


def test_bulk_masks_drop_p_of_the_elements_and_scale_the_rest_as_torch_does(bulk):
    torch.manual_seed(0)
    ones = torch.ones(1000, 1000)
    out = apply_dropout(ones, 0.1, True)
    dropped = (out == 0).double().mean().item()
    assert abs(dropped - 0.1) < 5 * (0.1 * 0.9 / ones.numel()) ** 0.5  # five standard deviations
    assert torch.equal(out[out != 0].unique(), torch.ones(1).div_(0.9))  # torch's 1 / (1 - p), in float32
    # The two int32 halves of each 64-bit draw go to neighbouring elements: neither half is biased.
    assert abs((out.view(-1)[0::2] == 0).double().mean().item() - 0.1) < 0.003
    assert abs((out.view(-1)[1::2] == 0).double().mean().item() - 0.1) < 0.003
    half = apply_dropout(torch.ones(999, dtype=torch.bfloat16), 0.5, True)  # odd size, another dtype
    assert half.dtype == torch.bfloat16 and set(half.unique().tolist()) <= {0.0, 2.0}


def test_bulk_masks_follow_the_global_seed(bulk):
    x = torch.randn(64, 256)
    torch.manual_seed(7)
    first, second = apply_dropout(x, 0.1, True), apply_dropout(x, 0.1, True)
    torch.manual_seed(7)
    assert torch.equal(apply_dropout(x, 0.1, True), first)  # a seed (or a restored RNG state) repeats the masks
    assert not torch.equal(first, second)  # the generator moves on


def test_bulk_dropout_backpropagates_through_the_same_mask(bulk):
    torch.manual_seed(0)
    x = torch.randn(32, 16, requires_grad=True)
    out = apply_dropout(x, 0.3, True)
    out.sum().backward()
    expected = (out != 0).float() * torch.ones(1).div_(0.7)
    torch.testing.assert_close(x.grad, expected, rtol=0, atol=0)


def test_evaluation_p0_and_p1_as_torch(bulk):
    x = torch.randn(4, 8)
    assert apply_dropout(x, 0.1, False) is x and apply_dropout(x, 0.0, True) is x
    assert torch.equal(apply_dropout(x, 1.0, True), torch.zeros_like(x))
    module = Dropout(0.1).eval()
    assert module(x) is x
    with pytest.raises(ValueError, match="dropout probability"):
        Dropout(1.5)


def test_where_torch_draws_in_bulk_itself_its_dropout_is_used(monkeypatch):
    monkeypatch.setattr(dropout_module, "torch_draws_one_at_a_time", lambda: False)
    x = torch.randn(128, 64)
    torch.manual_seed(3)
    ours = apply_dropout(x, 0.1, True)
    torch.manual_seed(3)
    assert torch.equal(ours, torch.nn.functional.dropout(x, 0.1, True))


def test_the_vendor_rule_reads_the_cpu():
    # torch's MKL draws are for Intel CPUs only (ATen's bernoulli_scalar_kernel): everyone else draws in bulk here.
    intel = dropout_module.cpu_vendor() == "GenuineIntel" and torch.backends.mkl.is_available()
    assert dropout_module.torch_draws_one_at_a_time() is (not intel)
