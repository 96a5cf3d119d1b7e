"""Decoding the flat gene list of Scale-aware AutoAugment, and rejecting bad ones."""

import numpy as np
import pytest

from pipelines.errors import ConfigError
from pipelines.policy import (
    COLOR_OPS,
    GEO_OPS,
    PUBLISHED_POLICY,
    BoxOp,
    Policy,
    SubPolicy,
    ZoomOp,
    decode_policy,
    op_table,
    policy_length,
)


# Genes decode as COLOR_OPS[g % len(COLOR_OPS)] and GEO_OPS[g % len(GEO_OPS)]: the lists' order and length
# are part of every stored policy's meaning (PUBLISHED_POLICY, the search's policy files, runs' params).
RE_MEANS = ("adding or reordering an op re-means every stored policy: op genes index COLOR_OPS and GEO_OPS modulo "
            "their length, so PUBLISHED_POLICY and every searched policy would decode to other ops. A new op is a new "
            "policy format: convert or re-search the stored policies, then update this test and docs/augmentation.md")


def test_op_order_is_the_originals():
    assert COLOR_OPS == ("AutoContrast", "Equalize", "SolarizeAdd", "Color", "Contrast", "Brightness",
                         "Sharpness"), RE_MEANS
    assert GEO_OPS == ("hflip", "rotate", "shearX", "shearY", "translateX", "translateY"), RE_MEANS


def test_published_policy_keeps_its_ops():
    """The published policy's op genes, read through the op lists, name the paper's ops: a change to the lists
    that moves any of them fails here."""
    policy = decode_policy(PUBLISHED_POLICY)
    ops = [(sub.color.name, sub.geometric.name) for sub in policy.subpolicies]
    assert ops == [("Color", "translateX"), ("Brightness", "rotate"), ("Sharpness", "shearX"),
                   ("SolarizeAdd", "hflip"), ("Color", "translateY")], RE_MEANS


def test_an_op_table_must_name_the_policys_ops_in_order():
    """The modules that implement ops (autoaug/color.py, autoaug/geometric.py) declare them through op_table."""
    table = {name: None for name in GEO_OPS}
    assert op_table(GEO_OPS, table) is table
    for wrong in ({**table, "scale": None}, dict(reversed(table.items())), dict(list(table.items())[1:])):
        with pytest.raises(AssertionError, match="differs from pipelines.policy's"):
            op_table(GEO_OPS, wrong)


def test_published_policy_decodes_to_the_papers_policy():
    assert len(PUBLISHED_POLICY) == 40
    policy = decode_policy(PUBLISHED_POLICY)
    assert policy == Policy(
        zoom_out=ZoomOp(prob=0.30, level=9),
        zoom_in=ZoomOp(prob=0.25, level=3),
        subpolicies=(
            SubPolicy(BoxOp("Color", 0.4, 2), BoxOp("translateX", 0.4, 4)),
            SubPolicy(BoxOp("Brightness", 0.2, 4), BoxOp("rotate", 0.4, 2)),
            SubPolicy(BoxOp("Sharpness", 0.4, 2), BoxOp("shearX", 0.2, 6)),
            SubPolicy(BoxOp("SolarizeAdd", 0.2, 2), BoxOp("hflip", 0.5, 1)),
            SubPolicy(BoxOp("Color", 0.0, 8), BoxOp("translateY", 0.2, 8)),
        ),
        area_ratios=(7, 5, 1),
        prob_ratios=(3, 3, 3),
    )


def test_op_genes_wrap_around_and_probabilities_scale():
    genes = [0] * 40
    genes[4], genes[5], genes[7], genes[8] = 9, 7, 8, 3  # 9 mod 7 = 2, 8 mod 6 = 2
    genes[0], genes[2] = 9, 1
    policy = decode_policy(genes)
    assert policy.subpolicies[0] == SubPolicy(BoxOp("SolarizeAdd", 0.7, 0), BoxOp("shearX", 0.3, 0))
    assert policy.zoom_out.prob == pytest.approx(0.45) and policy.zoom_in.prob == pytest.approx(0.05)


def test_number_of_subpolicies_sets_the_length():
    assert policy_length(5) == 40 and policy_length(2) == 22
    genes = list(range(10)) + list(range(10)) + [1, 2]
    policy = decode_policy(genes, n_subpolicies=2)
    assert len(policy.subpolicies) == 2
    assert policy.area_ratios == (6, 7, 8) and policy.prob_ratios == (9, 1, 2)


def test_numpy_integers_are_genes():
    assert decode_policy(np.array(PUBLISHED_POLICY)) == decode_policy(PUBLISHED_POLICY)


@pytest.mark.parametrize("bad, position, shown", [
    (12, 17, "12"), (-1, 0, "-1"), (3.5, 39, "3.5"), ("4", 5, "'4'"), (True, 22, "True"), (4.0, 3, "4.0"),
])
def test_a_bad_gene_is_named_by_position(bad, position, shown):
    genes = list(PUBLISHED_POLICY)
    genes[position] = bad
    with pytest.raises(ConfigError) as info:
        decode_policy(genes)
    message = str(info.value)
    assert message == f"augment.policy[{position}]: expected an integer 0..9, got {shown}"
    assert "\n" not in message


def test_wrong_length_says_what_is_expected():
    with pytest.raises(ConfigError) as info:
        decode_policy(PUBLISHED_POLICY[:-1])
    assert str(info.value) == "augment.policy: expected 40 genes for 5 sub-policies (4 + 6 * 5 + 6), got 39"
    with pytest.raises(ConfigError, match=r"expected 22 genes for 2 sub-policies \(4 \+ 6 \* 2 \+ 6\), got 40"):
        decode_policy(PUBLISHED_POLICY, n_subpolicies=2)


@pytest.mark.parametrize("bad", ["6,9,5,3", 7, None])
def test_not_a_list(bad):
    with pytest.raises(ConfigError, match=r"^augment\.policy: expected a list of integers 0\.\.9"):
        decode_policy(bad)


@pytest.mark.parametrize("bad", [0, -2, 2.0, True])
def test_bad_number_of_subpolicies(bad):
    with pytest.raises(ConfigError, match=r"^augment\.n_subpolicies: expected a positive integer"):
        decode_policy(PUBLISHED_POLICY, n_subpolicies=bad)


def test_str_lists_every_op_on_its_own_line():
    text = str(decode_policy(PUBLISHED_POLICY))
    lines = text.splitlines()
    assert len(lines) == 1 + 2 + 5 + 2
    assert lines[1].strip() == "zoom_out: p=0.30 level=9"
    assert lines[2].strip() == "zoom_in:  p=0.25 level=3"
    assert lines[3].strip() == "sub-policy 0: Color p=0.4 level=2, then translateX p=0.4 level=4"
    assert lines[-2].strip() == "area ratios (small, medium, large): 7, 5, 1"
    assert lines[-1].strip() == "prob ratios (small, medium, large): 3, 3, 3"
