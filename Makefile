# `make pipeline` installs (once) and runs the five DVC stages; `make test` installs and runs the tests;
# `make doctor` reports on the machine and predicts the pipeline's time on it; `make search` searches an
# augmentation policy on this data (docs/search.md); a team's lead runs `make team-server` (both team servers)
# and `make team-user NAME=...` per teammate, who runs `make team-join TEAM_ENV=...` (docs/team.md).
# The install is the pinned requirements.lock; `make lock` re-resolves it from pyproject.toml.
VENV ?= .venv
PYTHON ?= python3
BIN := $(abspath $(VENV))/bin
export PATH := $(BIN):$(PATH)

.PHONY: install pipeline test doctor search search-pipeline lock team-server team-user team-stop team-backup tracking-server s3-server team-join

# Every dependency at its locked version, then the project itself (editable, deps already there).
$(VENV)/.installed: pyproject.toml requirements.lock
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check -r requirements.lock
	$(BIN)/pip install --quiet --disable-pip-version-check --no-deps -e .
	touch $@

install: $(VENV)/.installed

# What DVC reads before any stage runs (its lock, params.yaml, dvc.yaml, every path it hashes) is checked
# first, in one line per problem (docs/failures.md); plain `dvc repro` skips the check.
pipeline: install
	python -m pipelines.check && dvc repro

# Two workers (pytest-xdist), each test file on one of them in order (the end-to-end files build on
# their own earlier tests): about 1.5x faster than one on 2 cores. `pytest -n 0` runs them in one process.
# (Handing them the longest files first, or a third worker, measured no faster: the work is CPU-bound.)
test: install
	pytest -n 2 --dist loadfile -rs --durations=25

# What this machine offers training, what `auto` resolves to, and how long `make pipeline` takes here.
doctor: install
	python -m pipelines.doctor

# The policy search, a pipeline of its own: search/pipeline.yaml copied to search/dvc.yaml, the name DVC knows
# (a copy, not a link: DVC reads a committed link as a file holding its target's name and refuses that commit);
# commit the copy, so that a colleague's DVC knows the search too. Then reproduced (about three hours on 2 cores,
# the confirmation included), and its result published into benchmarks/records/search/, which augment=searched
# trains (commit it).
search: install search-pipeline
	dvc repro search/dvc.yaml
	python -m stages.publish_search

# Edit search/pipeline.yaml, never search/dvc.yaml: each `make search` copies it again.
search-pipeline:
	rm -f search/dvc.yaml && cp search/pipeline.yaml search/dvc.yaml

# A team's lead: both servers in the background (the S3 server, and the MLflow server with auth and workspaces,
# its artifacts in the S3 server's bucket), their state in FOLDER (default outside the checkout:
# /var/lib/detection-pipelines as root, else ~/.local/share/detection-pipelines). HOST is where they listen,
# PUBLIC_URL where teammates reach the tracking server (S3's: the same host, port S3_PORT; or S3_PUBLIC_URL).
#   make team-server HOST=0.0.0.0 PUBLIC_URL=http://team.example:5000
#   make team-user NAME=alice          # writes FOLDER/users/alice.team.env (mode 600): hand it to alice
#   make team-user NAME=alice ARGS=--reset | ARGS=--remove;  make team-backup (FOLDER/backups/DATE);  make team-stop
HOST ?= 127.0.0.1
PORT ?= 5000
PUBLIC_URL ?=
S3_PORT ?= 9000
S3_PUBLIC_URL ?=
FOLDER ?=
NAME ?=
team-server: install
	python -m pipelines.team.lead server --host $(HOST) --port $(PORT) --s3-port $(S3_PORT) $(if $(PUBLIC_URL),--public-url $(PUBLIC_URL)) $(if $(S3_PUBLIC_URL),--s3-public-url $(S3_PUBLIC_URL)) $(if $(FOLDER),--folder $(FOLDER)) $(ARGS)

team-user: install
	python -m pipelines.team.lead user "$(NAME)" $(if $(FOLDER),--folder $(FOLDER)) $(ARGS)

team-stop: install
	python -m pipelines.team.lead stop $(if $(FOLDER),--folder $(FOLDER))

team-backup: install
	python -m pipelines.team.lead backup $(if $(FOLDER),--folder $(FOLDER)) $(ARGS)

# Each team server on its own. The MLflow server: PostgreSQL and `mlflow server` with proxied artifacts, in its state folder outside the checkout
# (/var/lib/detection-pipelines/tracking as root, else ~/.local/share/detection-pipelines/tracking; FOLDER=);
# prints the MLFLOW_TRACKING_URI to use (PUBLIC_URL, the address teammates reach it at; default
# http://HOST:PORT); Ctrl-C stops both. HOST is where it listens: auth is on unless it is loopback.
# PORT=5000 ARGS="--auth --workers 2" and so on. `make s3-server` (S3_PORT, S3_PUBLIC_URL): the DVC remote.
tracking-server: install
	python -m pipelines.team.mlflow_server --host $(HOST) --port $(PORT) $(if $(PUBLIC_URL),--public-url $(PUBLIC_URL)) $(if $(FOLDER),--folder $(FOLDER)) $(ARGS)

s3-server: install
	python -m pipelines.team.s3_server --host $(HOST) --port $(S3_PORT) $(if $(S3_PUBLIC_URL),--public-url $(S3_PUBLIC_URL)) $(ARGS)

# A teammate, after git clone: make team-join TEAM_ENV=path/to/team.env (mode 600, from the lead) checks it
# against both servers, writes .dvc/config.local and .team/settings.json (git-ignored), then dvc pull dvc.yaml.
TEAM_ENV ?=
team-join: install
	python -m pipelines.team.join --team-env "$(TEAM_ENV)" $(ARGS)

# After editing pyproject.toml: newest releases that satisfy it (Linux x86_64, Python 3.11).
lock: install
	$(BIN)/pip-compile --upgrade --extra dev --strip-extras --allow-unsafe \
	    --no-emit-index-url --no-emit-find-links --output-file requirements.lock pyproject.toml
