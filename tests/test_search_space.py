"""The search's smaller, scale-aware space (``search.space: scale``): its genome decodes to a whole policy with the
published box-level ops, mutation stays in range, its keys and state are its own, and a tiny search in it writes
a policy that ``augment=searched`` and the confirm stage train."""

import dataclasses
import json

import numpy as np
import pytest
import yaml

from pipelines.compose import compose_params
from pipelines.config.load import load_params, params_from_dict, read_policy_file
from pipelines.errors import ConfigError
from pipelines.policy import PUBLISHED_POLICY, decode_policy
from pipelines.search.confirm import arms, policy_file
from pipelines.search.evolution import Search, Settings, round_genomes
from pipelines.search.full_run import FullRun
from pipelines.search.genome import canonical, crossover, mutate, random_genome
from pipelines.search.pool import Scoring
from pipelines.search.proxy import fine_tune
from pipelines.search.record import SearchRecord, search_policy
from pipelines.search.space import space
from pipelines.tracking.tracker import Tracker

from . import proxy_fixture
from .conftest import REPO

SCALE = space("scale", 5)
LEVELS = [6, 9, 12, 15, 18, 21, 24, 27, 30, 33]  # the box-level ops' level genes in a 5-sub-policy policy
OPS_AND_PROBS = [i for i in range(4, 34) if i not in LEVELS]  # their op and probability genes
SETTINGS = Settings(rounds=2, population=3, kept=2, mutations=1, crossovers=1, random=0, mutation_prob=0.3, seed=3,
                    n_subpolicies=5, include=(SCALE.published(),), space="scale")


_with = proxy_fixture.with_values


def test_the_published_policy_is_the_scale_genome_of_strength_one_and_keys_differ_from_the_full_space():
    published = SCALE.published()
    assert published == (6, 9, 5, 3, 7, 5, 1, 3, 3, 3, 4) and SCALE.policy(published) == PUBLISHED_POLICY
    assert SCALE.key(published) == "s69537513334" and space("full", 5).key(PUBLISHED_POLICY) == "".join(
        map(str, PUBLISHED_POLICY))


@pytest.mark.parametrize("strength, levels", [
    (4, [2, 4, 4, 2, 2, 6, 2, 1, 8, 8]),  # x1: the published levels
    (0, [0, 1, 1, 0, 0, 1, 0, 0, 2, 2]),  # x0.2, rounded
    (2, [1, 2, 2, 1, 1, 4, 1, 1, 5, 5]),  # x0.6: 3.6 -> 4, 4.8 -> 5, 0.6 -> 1
    (9, [4, 8, 8, 4, 4, 9, 4, 2, 9, 9]),  # x2, clipped to 9
])
def test_a_scale_genome_decodes_to_its_zoom_and_ratios_over_the_published_box_ops(strength, levels):
    genome = (1, 2, 3, 4, 5, 6, 7, 8, 9, 0, strength)
    genes = SCALE.policy(genome)
    assert genes[:4] == (1, 2, 3, 4) and genes[34:] == (5, 6, 7, 8, 9, 0)
    assert [genes[i] for i in OPS_AND_PROBS] == [PUBLISHED_POLICY[i] for i in OPS_AND_PROBS]
    assert [genes[i] for i in LEVELS] == levels
    policy, published = decode_policy(genes), decode_policy(PUBLISHED_POLICY)
    assert policy.zoom_out.prob == 0.05 and policy.zoom_in.level == 4 and policy.area_ratios == (5, 6, 7)
    names = [[(op.name, op.prob) for op in (s.color, s.geometric)] for s in policy.subpolicies]
    assert names == [[(op.name, op.prob) for op in (s.color, s.geometric)] for s in published.subpolicies]
    assert SCALE.record(genome)["strength"] == pytest.approx((strength + 1) / 5)


def test_distinct_scale_genomes_decode_to_distinct_policies():
    rng = np.random.default_rng(0)
    genomes = {SCALE.random(rng) for _ in range(300)} | {SCALE.published()[:10] + (s,) for s in range(10)}
    assert len({SCALE.policy(g) for g in genomes}) == len(genomes)
    with pytest.raises(ConfigError, match="search.space: scale holds genomes of 11 genes, got one of 40"):
        SCALE.policy(PUBLISHED_POLICY)  # a full space's candidate


def test_random_mutation_and_crossover_stay_in_the_scale_space():
    rng = np.random.default_rng(1)
    kept = [SCALE.random(rng) for _ in range(3)]
    drawn = [*round_genomes(SETTINGS, 0, []), *(g for r in range(1, 6) for g in round_genomes(SETTINGS, r, kept))]
    drawn += [mutate(kept[0], rng, 1.0) for _ in range(50)] + [crossover(kept[0], kept[1], rng) for _ in range(50)]
    assert drawn[0] == SCALE.published()
    assert all(len(g) == 11 and all(0 <= x <= 9 for x in g) for g in drawn)
    assert len({g[10] for g in drawn}) > 5  # the strength is searched too
    assert all(len(SCALE.policy(g)) == 40 for g in drawn)


def test_the_full_space_draws_the_genomes_it_drew_before_the_option():
    full = dataclasses.replace(SETTINGS, include=(PUBLISHED_POLICY,), space="full")
    rng = np.random.default_rng([full.seed, 0])
    before = [canonical(g, 5) for g in [PUBLISHED_POLICY, random_genome(rng, 5), random_genome(rng, 5)]]
    assert round_genomes(full, 0, []) == before
    kept = before[:2]
    rng = np.random.default_rng([full.seed, 1])
    mutant = mutate(kept[rng.integers(2)], rng, full.mutation_prob)
    a, b = rng.choice(2, size=2, replace=False)
    assert round_genomes(full, 1, kept) == [canonical(g, 5) for g in (mutant, crossover(kept[a], kept[b], rng))]


@pytest.fixture(scope="module")
def tiny_proxy(tmp_path_factory):
    """A 2-iteration fine-tune on 6 train and 3 held-out images at 128-160 pixels, in the scale space."""
    return proxy_fixture.tiny_proxy(tmp_path_factory.mktemp("proxy"), load_params(REPO / "params.yaml"), max_side=160,
                                    max_objects=4, space="scale", rescore_top_k=0)


def test_the_search_state_is_reserved_for_its_space(tiny_proxy, tmp_path):
    scale = dataclasses.replace(SETTINGS, include=())
    full = dataclasses.replace(scale, space="full")
    proxy_full = dataclasses.replace(tiny_proxy, params=_with(tiny_proxy.params, "search", space="full"))
    first = SearchRecord.open(tmp_path, settings=full, proxy=proxy_full, baseline_sha256="x").fingerprint
    (tmp_path / "candidates").mkdir()
    assert SearchRecord.open(tmp_path, settings=full, proxy=proxy_full, baseline_sha256="x").fingerprint == first
    assert (tmp_path / "candidates").is_dir()  # its own state: kept
    other = SearchRecord.open(tmp_path, settings=scale, proxy=tiny_proxy, baseline_sha256="x").fingerprint
    assert other != first and not (tmp_path / "candidates").exists()  # the other space's state: emptied


class _InProcess:
    """The candidate pool's interface, fine-tuning in this process."""

    def __init__(self, proxy):
        self.proxy = proxy

    def fine_tunes(self, jobs):
        for genome, i in jobs:
            yield (genome, i), fine_tune(self.proxy, genome, i)


def test_a_tiny_search_in_the_scale_space_writes_a_policy_that_augment_searched_and_confirm_train(
        tiny_proxy, tmp_path, one_thread):
    p = tiny_proxy.params
    record = SearchRecord.open(tmp_path / "state", settings=SETTINGS, proxy=tiny_proxy, baseline_sha256="x")
    pool = _InProcess(tiny_proxy)
    comparators = record.comparators(pool, {}, Tracker())  # the null candidate, fine-tuned
    scoring = Scoring(pool, comparators, regulariser_weight=p.search.regulariser_weight, space=SCALE)
    search = Search(tmp_path / "state", SETTINGS)
    best = search.run(record.tracked(scoring.score, Tracker()))
    ranked = search.ranked()
    assert len(ranked) >= 3 and all(r["key"].startswith("s") and len(r["genome"]) == 11 for r in ranked)
    assert ranked[0] == best and len(search.history) == 2
    # the regulariser reads the decoded policy's probabilities: the published box ops' and the searched zooms'
    published = json.loads((tmp_path / "state" / "candidates" / "s69537513334.json").read_text())
    assert published["regulariser"] == pytest.approx((9 - (6 + 5 + 4 + 4 + 2 + 4 + 4 + 2 + 2 + 5 + 0 + 2) / 12)
                                                     * p.search.regulariser_weight)

    searched = yaml.safe_load(compose_params(REPO, ["augment=searched"]))
    path = tmp_path / "search_policy.json"
    path.write_text(json.dumps(search_policy(best, SETTINGS, scale_splits=p.augment.scale_splits,
                                             translate_relative=True)))
    trained = read_policy_file(params_from_dict({**searched, "augment": {**searched["augment"],
                                                                         "policy_file": str(path)}}))
    assert trained.augment.policy == list(SCALE.policy(best["genome"])) and trained.augment.scale_splits == \
        p.augment.scale_splits
    assert json.loads(path.read_text())["genome"] == best["genome"]

    # the confirm stage trains the best candidates with the genes they decode to, through the policy file
    found = arms(ranked, top_k=2, presets=[], compose=lambda _: searched["augment"],
                 scale_splits=p.augment.scale_splits, space=SCALE)
    run = FullRun(raw=searched, cache=tiny_proxy.cache, heldout=tiny_proxy.heldout, train_module="stages.train",
                  fraction=1.0, n_subpolicies=5)
    for arm, candidate in zip(found, ranked):
        work = tmp_path / arm.id
        work.mkdir()
        (work / "policy.json").write_text(json.dumps(policy_file(arm, 5)))
        confirmed = read_policy_file(params_from_dict(run.params(arm, 0, work)))
        assert confirmed.augment.policy == list(SCALE.policy(candidate["genome"])) and arm.id == f"g{candidate['key']}"
    with pytest.raises(ConfigError, match="search.space: full holds genomes of 40 genes, got one of 11"):
        arms(ranked, top_k=1, presets=[], compose=lambda _: searched["augment"], scale_splits=[1, 2, 3],
             space=space("full", 5))  # ranked by a search of the other space
