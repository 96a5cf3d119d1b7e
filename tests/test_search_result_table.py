"""The search-result table: a published search's confirm table and standing, read from its folder."""

import json

import pytest

from benchmarks import search_result
from benchmarks.record import RECORDS
from pipelines.errors import ConfigError


def _publish(folder, *, winner="sa_autoaug"):
    folder.mkdir(parents=True, exist_ok=True)
    arms = {"sa_autoaug": {"AP_s0": 0.80, "AP_s1": 0.78, "AP": 0.79, "APs": 0.7, "APm": 0.8, "APl": 0.85},
            "flip": {"AP_s0": 0.75, "AP_s1": 0.73, "AP": 0.74, "APs": 0.6, "APm": 0.8, "APl": 0.8},
            "search-1": {"AP_s0": 0.77, "AP_s1": 0.79, "AP": 0.78, "APs": 0.7, "APm": 0.8, "APl": 0.8,
                         "key": "123", "score": 0.101}}
    confirm = {"winner": winner, "winner_AP": arms[winner]["AP"], "seeds": [0, 1], "arms": arms,
               "published_AP": 0.79, "margin": arms[winner]["AP"] - 0.79}
    search = {"winner": "123", "winner_score": 0.101, "published_rank": 7, "published_score": 0.110,
              "margin": -0.009, "candidates": 120, "AP": 0.7}
    (folder / "confirm.json").write_text(json.dumps(confirm))
    (folder / "search.json").write_text(json.dumps(search))


def test_the_table_ranks_the_arms_by_held_out_AP_and_says_who_won(tmp_path):
    _publish(tmp_path)
    figures = search_result.measure(tmp_path)
    assert figures["search"] == {"winner": "123", "winner_score": 0.101, "published_rank": 7,
                                 "published_score": 0.110, "margin": -0.009}
    assert figures["candidates"] == 120
    lines = search_result.table(figures).splitlines()
    assert [line.split(" | ")[0] for line in lines[2:5]] == ["| sa_autoaug", "| search-1", "| flip"]
    assert lines[3] == "| search-1 | 0.770 | 0.790 | 0.780 | 0.700 | 0.800 | 0.800 | 0.1010 |"
    assert "Confirmed winner: sa_autoaug (held-out AP 0.790, +0.000 over the published policy)." in lines
    assert lines[-1].startswith("By the search's score: its best candidate 0.1010, the published genome 0.1100, ranked 7")


def test_an_unpublished_search_is_refused_in_one_line(tmp_path):
    (tmp_path / "confirm.json").write_text("{}")  # as committed before any search
    with pytest.raises(ConfigError, match=r"confirm.json: empty \(expected a published search"):
        search_result.measure(tmp_path)
    _publish(tmp_path / "half")
    (tmp_path / "half" / "search.json").unlink()
    with pytest.raises(ConfigError, match=r"search.json: not found"):
        search_result.measure(tmp_path / "half")


def test_the_kept_record_is_the_published_search():
    """The docs' table (record search-result) holds what benchmarks/records/search/ holds, unchanged: a search
    published again without its record rerun (or the other way round) fails."""
    if not (RECORDS / "search" / "confirm.json").is_file():
        pytest.skip("no search published yet (benchmarks/records/search/)")
    kept = json.loads((RECORDS / "search-result.json").read_text())["figures"]
    assert kept == json.loads(json.dumps(search_result.measure(RECORDS / "search")))
