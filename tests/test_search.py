"""The policy search's genome, score and evolution (with a made-up score: the proxy fine-tune is tested apart)."""

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from pipelines.policy import PUBLISHED_POLICY, decode_policy
from pipelines.search.evolution import Search, round_genomes
from pipelines.search.genome import canonical, crossover, key, mutate, probability_genes, random_genome
from pipelines.search.score import pareto_scale_balance, scale_balance

from .conftest import REPO
from .search_probe import SETTINGS, kill_when_scored, made_up_score, scorer


def test_the_probability_genes_are_the_zoom_and_op_probabilities_not_the_ratios():
    genes = probability_genes(5)
    assert genes == [0, 2, 5, 8, 11, 14, 17, 20, 23, 26, 29, 32]
    policy = decode_policy(PUBLISHED_POLICY)
    ops = [op for sub in policy.subpolicies for op in (sub.color, sub.geometric)]
    assert [PUBLISHED_POLICY[i] / 10 for i in genes[2:]] == [op.prob for op in ops]
    assert not set(genes) & set(range(34, 40))


def test_genomes_that_decode_to_the_same_policy_are_one_candidate():
    base = list(PUBLISHED_POLICY)
    base[4], base[7] = 1, 2  # Equalize and rotate in sub-policy 0
    other = list(base)
    other[4], other[7] = 8, 8  # 8 mod 7 and 8 mod 6: the same ops
    assert decode_policy(other) == decode_policy(base)
    assert key(other, 5) == key(base, 5) and canonical(other, 5) == tuple(base)
    changed = list(base)
    changed[5] = (changed[5] + 1) % 10  # a probability gene: another policy
    assert key(changed, 5) != key(base, 5)


def test_mutation_and_crossover_draw_genes_as_the_original_does():
    rng = np.random.default_rng(0)
    a, b = random_genome(rng, 5), random_genome(rng, 5)
    assert len(a) == 40 and all(0 <= g <= 9 for g in a)
    assert mutate(a, rng, 0.0) == a
    redrawn = [mutate(a, rng, 1.0) for _ in range(20)]
    assert all(0 <= g <= 9 for m in redrawn for g in m) and len({m for m in redrawn}) == 20
    changed = np.mean([sum(x != y for x, y in zip(a, mutate(a, rng, 0.1))) for _ in range(2000)])
    assert 3.2 < changed < 4.0  # 40 genes x 0.1 x 9/10 (a redraw keeps the gene 1 time in 10)
    child = crossover(a, b, rng)
    assert all(c in (x, y) for c, x, y in zip(child, a, b))
    from_a = np.mean([sum(c == x != y for c, x, y in zip(crossover(a, b, rng), a, b)) for _ in range(2000)])
    assert abs(from_a - sum(x != y for x, y in zip(a, b)) / 2) < 0.5


def test_the_score_uses_the_unbiased_spread_and_the_original_terms():
    ones = [9] * 40
    assert scale_balance([1, 1, 1, 1]) == 0.0
    assert scale_balance([3, 0, 0, 0]) == pytest.approx(0.5)  # N - 1; the biased spread would be 0.433
    assert pareto_scale_balance([3, 0, 0, 0], [0.5, 0.5, 0.5], [0.4, 0.4, 0.4], ones, 5) == pytest.approx(0.5)
    # an AP below the baseline's multiplies by baseline / AP; -1 (no such objects) and higher APs do not
    assert pareto_scale_balance([3, 0, 0, 0], [0.1, -1, 0.5], [0.2, 0.4, 0.4], ones, 5) == pytest.approx(1.0)
    assert pareto_scale_balance([3, 0, 0, 0], [0.1, 0.2, 0.5], [0.2, 0.4, 0.4], ones, 5) == pytest.approx(2.0)
    assert math.isfinite(pareto_scale_balance([3, 0, 0, 0], [0.0, 0.5, 0.5], [0.2, 0.4, 0.4], ones, 5))
    # the anti-collapse term reads the 12 probability genes only
    genome = list(ones)
    for i in range(34, 40):
        genome[i] = 0
    assert pareto_scale_balance([1, 1, 1, 1], [1, 1, 1], [0, 0, 0], genome, 5) == 0.0
    genome[0] = 0  # one probability gene of 12 from 9 to 0: the mean drops by 0.75
    assert pareto_scale_balance([1, 1, 1, 1], [1, 1, 1], [0, 0, 0], genome, 5) == pytest.approx(0.0075)
    with pytest.raises(ValueError, match="no loss"):
        scale_balance([0, 0, 0, 0])


def test_each_round_draws_its_genomes_from_the_settings_and_the_kept_set_only():
    kept = [random_genome(np.random.default_rng(i), 5) for i in range(3)]
    assert round_genomes(SETTINGS, 2, kept) == round_genomes(SETTINGS, 2, kept)
    assert round_genomes(SETTINGS, 2, kept) != round_genomes(SETTINGS, 3, kept)
    assert len(round_genomes(SETTINGS, 0, [])) == SETTINGS.population
    assert len(round_genomes(SETTINGS, 1, kept)) == SETTINGS.mutations + SETTINGS.crossovers + SETTINGS.random
    with_published = SETTINGS.__class__(**{**SETTINGS.__dict__, "include": (PUBLISHED_POLICY,)})
    assert round_genomes(with_published, 0, [])[0] == canonical(PUBLISHED_POLICY, 5)


def test_the_search_improves_scores_each_candidate_once_and_keeps_the_best(tmp_path):
    seen = []

    def counting(genomes):
        seen.extend(key(g, 5) for g in genomes)
        yield from scorer(0.0)(genomes)

    rounds = []
    best = Search(tmp_path, SETTINGS).run(counting, on_round=rounds.append)
    history = json.loads((tmp_path / "history.json").read_text())
    assert [entry["round"] for entry in history] == [0, 1, 2, 3] and history == rounds
    assert len(seen) == len(set(seen))  # never scored twice
    every = {k for entry in history for k in entry["candidates"]}
    assert set(seen) == every
    assert best["score"] == min(made_up_score(canonical(json.loads((tmp_path / "candidates" / f"{k}.json").read_text())
                                                        ["genome"], 5)) for k in every)
    bests = [entry["best"]["score"] for entry in history]
    assert bests == sorted(bests, reverse=True) and bests[-1] < bests[0]  # the kept set carries the best on
    assert all(len(entry["kept"]) == SETTINGS.kept for entry in history)
    # run again: nothing left to do, nothing scored
    seen.clear()
    assert Search(tmp_path, SETTINGS).run(counting) == best and seen == []


def test_a_search_that_failed_mid_round_resumes_to_the_uninterrupted_history(tmp_path):
    whole = tmp_path / "whole"
    Search(whole, SETTINGS).run(scorer(0.0))

    def failing(after):
        def score(genomes):
            for n, item in enumerate(scorer(0.0)(genomes)):
                if n == after:
                    raise KeyboardInterrupt
                yield item
        return score

    part = tmp_path / "part"
    for after in (3, 2, 4):  # three interruptions, each in another round
        with pytest.raises(KeyboardInterrupt):
            Search(part, SETTINGS).run(failing(after))
    Search(part, SETTINGS).run(scorer(0.0))
    assert (part / "history.json").read_text() == (whole / "history.json").read_text()


def test_a_killed_search_process_resumes_to_the_uninterrupted_history(tmp_path):
    """SIGKILL (of the process this test started) while candidates are being scored, then run again."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    whole, part = tmp_path / "whole", tmp_path / "part"
    done = subprocess.run([sys.executable, "-m", "tests.search_probe", str(whole)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    process = subprocess.Popen([sys.executable, "-m", "tests.search_probe", str(part), "--delay", "0.05"], cwd=REPO,
                               env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    kill_when_scored(process, part, 12, rounds=SETTINGS.rounds, timeout=60)
    again = subprocess.run([sys.executable, "-m", "tests.search_probe", str(part)], cwd=REPO, env=env,
                           capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr
    assert again.stdout == done.stdout
    assert (part / "history.json").read_text() == (whole / "history.json").read_text()
    assert not [p for p in part.rglob("*") if p.name.startswith(".")]  # no half-written file
