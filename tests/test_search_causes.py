"""The search-causes benchmark: what a finished search's kept candidates say about its score."""

import json

import pytest

from benchmarks import search_causes
from pipelines.errors import ConfigError


def _candidate(key, score, regulariser, penalty, ap, round_, seed_scores=None):
    return {"key": key, "score": score, "regulariser": regulariser, "pareto_penalty": penalty, "AP": ap,
            "round": round_, "seed_scores": seed_scores or [score], "genome": [0]}


def test_the_causes_are_read_from_the_candidates_a_search_keeps(tmp_path):
    (tmp_path / "candidates").mkdir()
    (tmp_path / "null").mkdir()
    for c in (_candidate("a", 0.10, 0.06, 1.0, 0.50, 0), _candidate("b", 0.12, 0.09, 1.2, 0.60, 0),
              _candidate("p", 0.15, 0.00, 1.5, 0.70, 0), _candidate("c", 0.08, 0.02, 1.0, 0.55, 1, [0.07, 0.09])):
        (tmp_path / "candidates" / f"{c['key']}.json").write_text(json.dumps(c))
    (tmp_path / "null" / "0.json").write_text(json.dumps({"AP": 0.55}))
    figures = search_causes.measure(tmp_path, "p")
    r0, whole = figures["round0"], figures["all"]
    assert figures["rounds"] == 2 and r0["candidates"] == 3 and whole["candidates"] == 4
    assert r0["penalty_fired"] == 2 and r0["winner"] == "a" and r0["winner_without_regulariser"] == "b"
    assert r0["winner_wins_without_regulariser"] is False
    assert r0["published_rank"] == 3 and whole["published_rank"] == 4 and whole["published_rank_without_regulariser"] == 4
    assert r0["spearman_score_AP"] == pytest.approx(-1)  # the better the score, the worse the held-out AP
    assert r0["best_AP"] == 0.70 and r0["best_AP_rank"] == 3 and r0["beat_null"] == 2
    assert whole["winner"] == "c" and whole["rescored"] == 1 and whole["score_sd_over_seeds"] == pytest.approx(0.02 ** 0.5 / 10)
    assert r0["regulariser_sd"] == pytest.approx(0.0458258, abs=1e-7) and r0["rest_sd"] == pytest.approx(0.0665833, abs=1e-7)
    assert "| Pareto penalty fired (above 1) | 2 | 2 |" in search_causes.table(figures)


def test_a_search_that_kept_no_candidate_is_refused_in_one_line(tmp_path):
    with pytest.raises(ConfigError, match=r"candidates: no scored candidate \(expected a finished search"):
        search_causes.measure(tmp_path, "p")
