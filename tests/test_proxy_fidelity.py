"""The proxy-fidelity benchmark: the confirm stage's policies fine-tuned by both proxies, as the search
fine-tunes them, and ranked against the full schedule's AP."""

import json

import pytest

from benchmarks import proxy_fidelity
from pipelines.config.load import load_params
from pipelines.errors import ConfigError
from pipelines.search.proxy import fine_tune
from pipelines.search.score import scale_balance
from pipelines.search.space import space

from . import proxy_fixture
from .conftest import REPO


def test_spearman_ranks_with_ties_averaged_and_refuses_what_has_no_ranking():
    assert proxy_fidelity.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1)
    assert proxy_fidelity.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1)
    assert proxy_fidelity.spearman([1, 2, 3, 4], [1, 1, 2, 3]) == pytest.approx(0.9486833)  # scipy.stats.spearmanr
    assert proxy_fidelity.spearman([1, 2], [1, 2]) is None and proxy_fidelity.spearman([1, 2, 3], [5, 5, 5]) is None


@pytest.fixture(scope="module")
def finished_search(tmp_path_factory):
    """A search folder as a finished search leaves it: the baseline, caches, held-out ground truth, one ranked
    candidate and a confirm table over it, the published policy, flip and trivial_zoom."""
    root = tmp_path_factory.mktemp("fidelity")
    proxy = proxy_fixture.tiny_proxy(root / "tiny", load_params(REPO / "params.yaml"), max_side=192, max_objects=5,
                                     candidates_at_once=2, threads=1)
    search = root / "search"
    (search / "outputs" / "baseline").mkdir(parents=True)
    (search / "data" / "prepared").mkdir(parents=True)
    (search / "metrics").mkdir()
    (search / "outputs" / "baseline" / "model_final.pth").symlink_to(proxy.baseline)
    (search / "data" / "cache").symlink_to(proxy.cache)
    (search / "data" / "prepared" / "val.json").symlink_to(proxy.heldout)
    genes = space(proxy.params.search.space, proxy.params.augment.n_subpolicies)
    candidate = list(genes.published())
    candidate[0] = (candidate[0] + 1) % 10
    ranked = [{"key": genes.key(candidate), "genome": candidate, "score": 0.1}]
    (search / "outputs" / "ranked.json").write_text(json.dumps(ranked))
    arms = {"sa_autoaug": {"AP": 0.5}, "flip": {"AP": 0.3}, "trivial_zoom": {"AP": 0.4},
            "search-1": {"AP": 0.45, "key": genes.key(candidate), "score": 0.1}}
    (search / "metrics" / "confirm.json").write_text(json.dumps({"arms": arms, "seeds": [0, 1]}))
    return proxy, search, tuple(candidate)


def test_both_proxies_fine_tune_every_confirmed_policy_as_the_search_does(finished_search, one_thread):
    proxy, search, candidate = finished_search
    figures = proxy_fidelity.measure(proxy.params, search=search, seeds=2)
    fair, original = figures["proxies"]["fair"], figures["proxies"]["original"]
    assert set(fair["arms"]) == set(original["arms"]) == {"sa_autoaug", "flip", "trivial_zoom", "search-1"}
    assert fair["settings"]["common_random_numbers"] is True and original["settings"] == proxy_fidelity.ORIGINAL
    # the searched candidate's first fine-tune is the search's own, bit for bit
    own = fine_tune(proxy, candidate, 0)
    assert fair["arms"]["search-1"]["per_seed_AP"][0] == own["AP"]
    flip = fair["arms"]["flip"]  # the null candidate is its own comparator: no penalty, the score is the balance
    assert flip["per_seed_score"][0] == pytest.approx(scale_balance(fine_tune(proxy, None, 0)["bins"]))
    assert flip["regulariser"] is None and fair["arms"]["search-1"]["regulariser"] > 0
    assert fine_tune(proxy, None, 0, preset="trivial_zoom")["bins"] != fine_tune(proxy, None, 0)["bins"]
    assert [fair["arms"][a]["full_AP"] for a in ("sa_autoaug", "flip")] == [0.5, 0.3]
    for figures_ in (fair, original):
        assert figures_["spearman_AP"] is None or -1 <= figures_["spearman_AP"] <= 1
    assert "| Spearman with the full schedule's AP: by proxy AP |" in proxy_fidelity.table(figures)


def test_a_search_without_a_confirm_table_is_refused_in_one_line(finished_search, tmp_path):
    proxy, _, _ = finished_search
    (tmp_path / "metrics").mkdir()
    (tmp_path / "metrics" / "confirm.json").write_text("{}")  # as committed before any search
    with pytest.raises(ConfigError, match=r"confirm.json: no confirm table \(expected a finished search"):
        proxy_fidelity.measure(proxy.params, search=tmp_path, seeds=1)
