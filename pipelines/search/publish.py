"""A finished search's result in the repository: its policy file and metrics copied into a committed folder, and
the ``searched`` preset of ``conf/augment/`` written to train the policy file there.

The search writes its policy file as a DVC output (``search/outputs/policy.json``: in DVC's cache, not in git,
and replaced by the next search) and its metrics beside it; which files, :func:`outputs` reads from the search
pipeline's own ``paths`` (``search/pipeline.yaml``), so they are named once. Published, the five files
(``policy.json``, ``search.json``, ``curve.json``, ``bins.json``, ``confirm.json``) are committed together, so
``augment=searched`` trains in any clone without the search, the train stage depends on a committed file, and
"did the search beat its own seed, by how much" has its answer in the repository. The folder is replaced in one
rename: a publish stopped at any moment leaves the previous one whole.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import yaml

from ..errors import ConfigError, SearchError, first_line
from ..fileio import atomic_dir, atomic_write_bytes
from ..policy import decode_policy

# the committed file: the search pipeline's ``paths`` entry that names where the search writes it
PUBLISHED = {"policy.json": "policy", "search.json": "metrics", "curve.json": "curve", "bins.json": "bins",
             "confirm.json": "confirm_metrics"}
POLICY = "policy.json"
RUN_SEARCH = "run the search (make search)"


def outputs(pipeline: Path) -> dict[str, Path]:
    """Where the search of ``pipeline`` (``search/pipeline.yaml``, whose stages run from the folder above it) writes
    each file :data:`PUBLISHED` names, by its committed name."""
    try:
        found = yaml.safe_load(pipeline.read_text())
        paths = next(v["paths"] for v in found["vars"] if isinstance(v, dict) and "paths" in v)
        root = pipeline.parent.parent
        return {name: root / paths[key] for name, key in PUBLISHED.items()}
    except (OSError, yaml.YAMLError, KeyError, TypeError, StopIteration) as err:
        raise SearchError(f"{pipeline}: expected the search pipeline with a vars entry 'paths' naming "
                          f"{', '.join(PUBLISHED.values())} ({type(err).__name__}: {first_line(err)})") from None


def read_result(sources: Mapping[str, Path]) -> dict[str, bytes]:
    """The bytes of each file of a finished search (``sources``: committed name -> where the search wrote it),
    checked: each there, readable JSON and not the empty placeholder an unfinished search leaves, the policy
    file one that ``augment=searched`` can train, and the policy file, the confirm table and the search's metrics
    of one search. Raises :class:`SearchError` naming the file."""
    data, found = {}, {}
    for name, path in sources.items():
        if not path.is_file():
            raise SearchError(f"{path}: not found; {RUN_SEARCH} before publishing it")
        data[name] = path.read_bytes()
        try:
            found[name] = json.loads(data[name])
        except ValueError as err:
            raise SearchError(f"{path}: not readable JSON ({first_line(err)}); {RUN_SEARCH} again") from None
        if not found[name]:
            raise SearchError(f"{path}: empty, the search has not finished; {RUN_SEARCH} to its end")
    _check_policy(found[POLICY], sources[POLICY])
    _check_same_search(found, sources)
    return data


def _check_policy(policy: object, path: Path) -> None:
    if isinstance(policy, dict) and isinstance(policy.get("augment"), dict):
        return  # a preset won the confirmation: its augment section, validated where it trains
    if not (isinstance(policy, dict) and isinstance(policy.get("policy"), list)
            and isinstance(policy.get("n_subpolicies"), int)):
        raise SearchError(f"{path}: expected a policy file with a 'policy' gene list and 'n_subpolicies', or an "
                          "'augment' section")
    try:
        decode_policy(policy["policy"], policy["n_subpolicies"])
    except ConfigError as err:
        raise SearchError(f"{path}: {err}") from None


def _check_same_search(found: Mapping[str, dict], sources: Mapping[str, Path]) -> None:
    """The confirm table's winner is the policy file's arm, and its best candidate the search's winner."""
    policy, table, metrics = found[POLICY], found["confirm.json"], found["search.json"]
    if "winner" not in table or "arms" not in table:
        raise SearchError(f"{sources['confirm.json']}: expected the confirm table (winner, arms); {RUN_SEARCH} again")
    if "winner" not in metrics:
        raise SearchError(f"{sources['search.json']}: no 'winner': written by an earlier search stage; run it again "
                          "(dvc repro -s -f search/dvc.yaml:search, quick where its state folder is kept)")
    if policy.get("arm", table["winner"]) != table["winner"]:
        raise SearchError(f"{sources[POLICY]}: holds {policy['arm']}, but the confirm table's winner is "
                          f"{table['winner']}: the files are of different searches; {RUN_SEARCH} again")
    best = table["arms"].get("search-1", {}).get("key")
    if best is not None and best != metrics["winner"]:
        raise SearchError(f"{sources['search.json']}: its winner is {metrics['winner']}, but the confirm table's "
                          f"search-1 is {best}: the files are of different searches; {RUN_SEARCH} again")


def preset_text(policy_file: str) -> str:
    """The ``searched`` preset: the published Scale-aware AutoAugment preset with the policy of ``policy_file``."""
    return f"""\
# Written by `python -m stages.publish_search` (`make search` runs it after the search): run it again rather than
# edit this file. Scale-aware AutoAugment with the policy that the search (search/pipeline.yaml) confirmed on this
# dataset: the genes and scale bounds come from the published policy file, committed with the search's metrics
# beside it, which the train stage then depends on (a newly published search re-runs train and evaluate).
# Everything else as the published preset. Where a preset that is not a gene list (flip, say) won the search's
# confirmation, the file holds that preset's augment section, and training takes it instead.
defaults:
  - sa_autoaug
  - _self_
policy: null
policy_file: {policy_file}
"""


def publish(sources: Mapping[str, Path], folder: Path, preset: Path, *, policy_file: str) -> dict:
    """Copy a finished search's files (``sources``, checked by :func:`read_result`) into ``folder``, byte for
    byte, replacing what it held in one rename; then write ``preset`` to read ``policy_file`` (the policy file
    in ``folder``, as the train stage names it). Returns the policy file's content."""
    data = read_result(sources)
    with atomic_dir(folder) as tmp:
        for name, content in data.items():
            (tmp / name).write_bytes(content)
    atomic_write_bytes(preset, preset_text(policy_file).encode())
    return json.loads(data[POLICY])
