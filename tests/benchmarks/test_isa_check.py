"""bench/isa_check.py: the demo's start under the pins does not move when MKL may not use AVX2 (as on a CPU whose MKL
has no AVX2 branch, e.g. AMD's), which the old MKL_CBWR=AVX2 pin did not guarantee (docs/reproducibility.md)."""

import pytest

pytest.importorskip("transformers")


def test_pinned_variants_agree_at_a_few_warm_start_steps():
    from bench.isa_check import check, variants

    names = ["pinned", "pinned, MKL as without AVX2"]
    assert set(names) <= set(variants())
    results, same = check(3, names)
    assert same, results
    assert results["pinned"]["data"] == results["pinned, MKL as without AVX2"]["data"]
    with pytest.raises(ValueError, match="--variants: unknown"):
        check(3, ["no such variant"])
