"""The search's fair score: its three terms, the best rescored at more seeds (resumable), common random
numbers, the null candidate as the Pareto comparator, and the proxy's warmup and relative translate."""

import dataclasses
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from pipelines.config.load import load_params
from pipelines.data.autoaug.geometric import geometric_op
from pipelines.policy import PUBLISHED_POLICY
from pipelines.search.evolution import Search
from pipelines.search.genome import key, probability_genes
from pipelines.search.proxy import (WARMUP_FACTOR, candidate_seed, fine_tune, fine_tune_params,
                                    fine_tune_seed, search_params)
from pipelines.search.record import SearchRecord
from pipelines.search.score import pareto_scale_balance, score_terms
from pipelines.tracking.tracker import Tracker

from . import proxy_fixture
from .conftest import REPO
from .search_probe import RESCORED, kill_when_scored, noisy_score, rescorer, scorer


_with = proxy_fixture.with_values


@pytest.fixture(scope="module")
def params():
    return load_params(REPO / "params.yaml")


def test_the_score_keeps_its_three_terms_and_weighs_its_regulariser():
    genome = list(PUBLISHED_POLICY)
    mean = np.mean([genome[i] for i in probability_genes(5)])
    terms = score_terms([3, 1, 1, 1], [0.1, 0.4, -1], [0.2, 0.3, 0.5], genome, 5, regulariser_weight=0.002)
    assert terms["balance"] == pytest.approx(1 / 6)  # shares 1/2, 1/6, 1/6, 1/6: std (N - 1)
    assert terms["pareto_penalty"] == pytest.approx(2.0)  # only APs falls below the comparator's; -1 counts nothing
    assert terms["regulariser"] == pytest.approx((9 - mean) * 0.002)
    assert terms["score"] == pytest.approx(terms["balance"] * terms["pareto_penalty"] + terms["regulariser"])
    dropped = score_terms([3, 1, 1, 1], [0.1, 0.4, -1], [0.2, 0.3, 0.5], genome, 5, regulariser_weight=0.0)
    assert dropped["regulariser"] == 0.0 and dropped["score"] == pytest.approx(1 / 3)
    # the original's score is the weight 0.01
    assert pareto_scale_balance([3, 1, 1, 1], [0.1, 0.4, -1], [0.2, 0.3, 0.5], genome, 5) == pytest.approx(
        1 / 3 + (9 - mean) * 0.01)


def test_the_best_are_rescored_before_they_become_parents_and_keep_each_seeds_score(tmp_path):
    asked = []

    def rescore(jobs):
        asked.extend(jobs)
        yield from rescorer(0.0)(jobs)

    search = Search(tmp_path, RESCORED)
    best = search.run(scorer(0.0, noisy=True), rescore=rescore)
    history = json.loads((tmp_path / "history.json").read_text())
    every = [json.loads(p.read_text()) for p in (tmp_path / "candidates").glob("*.json")]
    rescored = [r for r in every if "rescored_round" in r]
    assert {i for _, i in asked} == {1, 2} and len(asked) == 2 * len(rescored)  # each rescored once, at 2 more seeds
    for r in rescored:
        assert r["seed_scores"] == pytest.approx([noisy_score(r["genome"], i) for i in range(3)])
        assert r["score"] == pytest.approx(np.mean(r["seed_scores"])) and [x["score"] for x in r["rescores"]] == \
            r["seed_scores"][1:]
    for r in every:
        if "rescored_round" not in r:
            assert r["score"] == r["seed_scores"][0] == noisy_score(r["genome"], 0)
    # at every round's end its top 2 are rescored (some more were, and fell out of the top), each in its own round
    assert all(r["rescored_round"] == r["round"] for r in rescored)
    for entry in history:
        ranked = sorted((r for r in every if r["round"] <= entry["round"]), key=lambda r: (
            r["score"] if r.get("rescored_round", 99) <= entry["round"] else r["seed_scores"][0], r["key"]))
        assert all(r.get("rescored_round", 99) <= entry["round"] for r in ranked[:RESCORED.rescore_top_k])
    assert sum(len(e["rescored"]) for e in history) == len(rescored) > len(history) * RESCORED.rescore_top_k
    assert best["key"] == history[-1]["best"]["key"] and "rescored_round" in best
    # the next round's parents are ranked by the means where rescored
    so_far = sorted((r for r in every if r["round"] <= 1), key=lambda r: (r["score"], r["key"]))
    assert history[1]["kept"] == [r["key"] for r in so_far[:RESCORED.kept]]


def test_a_search_that_failed_mid_rescoring_resumes_to_the_uninterrupted_history(tmp_path):
    whole, part = tmp_path / "whole", tmp_path / "part"
    Search(whole, RESCORED).run(scorer(0.0, noisy=True), rescore=rescorer(0.0))

    def failing(after):
        def rescore(jobs):
            for n, item in enumerate(rescorer(0.0)(jobs)):
                if n == after:
                    raise KeyboardInterrupt
                yield item
        return rescore

    stops = 0
    while True:  # killed after every rescoring's first seed: between a candidate's two seeds, in every round
        try:
            Search(part, RESCORED).run(scorer(0.0, noisy=True), rescore=failing(1 if stops % 3 else 0))
            break
        except KeyboardInterrupt:
            stops += 1
    assert stops > 2 * RESCORED.rounds
    assert (part / "history.json").read_text() == (whole / "history.json").read_text()
    for path in (whole / "candidates").glob("*.json"):
        assert (part / "candidates" / path.name).read_text() == path.read_text()


def test_a_killed_search_process_resumes_mid_rescoring_to_the_uninterrupted_history(tmp_path):
    """SIGKILL (of the process this test started) while the best are being rescored, then run again."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    whole, part = tmp_path / "whole", tmp_path / "part"
    probe = [sys.executable, "-m", "tests.search_probe", "--rescore"]
    done = subprocess.run([*probe, str(whole)], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    process = subprocess.Popen([*probe, str(part), "--delay", "0.02"], cwd=REPO, env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    kill_when_scored(process, part, 9, rounds=RESCORED.rounds, timeout=60, files="rescores")
    again = subprocess.run([*probe, str(part)], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr
    assert again.stdout == done.stdout
    assert (part / "history.json").read_text() == (whole / "history.json").read_text()


def test_the_proxy_warms_up_over_half_the_fine_tune_and_scales_translate(params):
    tuned = fine_tune_params(search_params(params))
    assert tuned.augment.scale_splits == [210, 1049, 5243]  # search.scale_splits auto: what policy.json trains with
    assert params.search.proxy_warmup_fraction == 0.5 and params.search.fine_tune_iters == 100
    assert (tuned.train.max_iter, tuned.train.warmup_iters, tuned.train.warmup_factor) == (100, 50, WARMUP_FACTOR)
    assert tuned.augment.translate_relative and not params.augment.translate_relative  # on in the proxy only
    cold = fine_tune_params(_with(params, "search", proxy_warmup_fraction=0.0, translate_relative=False))
    assert cold.train.warmup_iters == 0 and not cold.augment.translate_relative


def test_common_random_numbers_give_every_candidate_one_seed_per_seed_index(params):
    a, b = key(PUBLISHED_POLICY, 5), key([1] * 40, 5)
    assert params.search.common_random_numbers
    assert fine_tune_seed(params, a) == fine_tune_seed(params, b) != fine_tune_seed(params, a, 1)
    assert fine_tune_seed(params, a, 1) == fine_tune_seed(params, "null", 1) != fine_tune_seed(params, a, 2)
    own = _with(params, "search", common_random_numbers=False)
    assert fine_tune_seed(own, a) == candidate_seed(params.search.seed, a)  # as before: seeded by its genes
    assert len({fine_tune_seed(own, a), fine_tune_seed(own, b), fine_tune_seed(own, a, 1)}) == 3


@pytest.mark.parametrize("side, relative, offset", [(256, False, 120), (256, True, 38), (800, True, 120)])
def test_relative_translate_scales_the_originals_pixels_by_the_shorter_side(side, relative, offset):
    image = torch.zeros(3, side, side + 64, dtype=torch.uint8)
    target = {"boxes": torch.tensor([[40.0, 40.0, 60.0, 60.0]]), "labels": torch.tensor([1])}
    rng = np.random.default_rng(1)  # its first draw, 0.51, keeps the sign
    _, out = geometric_op("translateY", image, target, level=10, selected=np.array([True]), rng=rng,
                          translate_relative=relative)
    assert out["boxes"][1].tolist() == [40.0, 40.0 + offset, 60.0, 60.0 + offset]


@pytest.fixture(scope="module")
def tiny_proxy(params, tmp_path_factory):
    """A 2-iteration fine-tune on 6 train and 3 held-out images at 128-192 pixels."""
    return proxy_fixture.tiny_proxy(tmp_path_factory.mktemp("proxy"), params, max_side=192, max_objects=5)


def test_with_common_random_numbers_a_policy_that_never_fires_is_the_null_candidate(tiny_proxy, one_thread):
    """The same data order and draws: a policy whose probabilities are all 0 fine-tunes to the null
    candidate's bits; with each candidate's own random numbers it does not."""
    idle = list(PUBLISHED_POLICY)
    for i in probability_genes(5):
        idle[i] = 0
    null, same = (fine_tune(tiny_proxy, genome) for genome in (None, tuple(idle)))
    assert {k: v for k, v in null.items() if k != "seconds"} == {k: v for k, v in same.items() if k != "seconds"}
    own = dataclasses.replace(tiny_proxy, params=_with(tiny_proxy.params, "search", common_random_numbers=False))
    assert fine_tune(own, tuple(idle))["bins"] != null["bins"]


class _FakePool:
    def __init__(self):
        self.jobs = []

    def fine_tunes(self, jobs):
        self.jobs += jobs
        for genome, i in jobs:
            yield (genome, i), {"bins": [1.0, 2.0, 3.0, 4.0 + i], "AP": 0.5, "APs": 0.1 * i, "APm": 0.2, "APl": 0.3,
                                "seconds": 1.0}


def test_the_null_candidate_is_fine_tuned_once_per_seed_and_kept(tmp_path):
    settings = dataclasses.replace(RESCORED, rescore_top_k=3, rescore_seeds=2)
    baseline = {"AP": 0.4, "APs": 0.3, "APm": 0.2, "APl": 0.1}
    record = SearchRecord(tmp_path, "f", settings, "detection", "null_candidate")
    pool = _FakePool()
    found = record.comparators(pool, baseline, Tracker())
    assert pool.jobs == [(None, 0), (None, 1), (None, 2)] and sorted(found) == [0, 1, 2]
    assert [found[i]["APs"] for i in range(3)] == [0.0, 0.1, 0.2]
    assert record.comparators(pool, baseline, Tracker()) == found and len(pool.jobs) == 3  # kept: resumed, not redone
    single = SearchRecord(tmp_path / "b", "f", dataclasses.replace(settings, rescore_top_k=0), "detection", "baseline")
    assert single.comparators(pool, baseline, Tracker()) == {0: baseline} and len(pool.jobs) == 3


def test_the_score_settings_are_in_the_search_fingerprint(tiny_proxy, tmp_path):
    state = tmp_path / "state"
    first = SearchRecord.open(state, settings=RESCORED, proxy=tiny_proxy, baseline_sha256="x").fingerprint
    (state / "candidates").mkdir()
    for change in ({"regulariser_weight": 0.01}, {"pareto_comparator": "baseline"}, {"common_random_numbers": False},
                   {"proxy_warmup_fraction": 0.0}, {"translate_relative": False}):
        other = dataclasses.replace(tiny_proxy, params=_with(tiny_proxy.params, "search", **change))
        assert SearchRecord.open(tmp_path / "other", settings=RESCORED, proxy=other,
                                 baseline_sha256="x").fingerprint != first, change
    assert SearchRecord.open(state, settings=RESCORED, proxy=tiny_proxy, baseline_sha256="x").fingerprint == first
    assert (state / "candidates").is_dir()  # the same settings: the state is kept
