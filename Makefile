# The two commands of the README. Both create .venv on first use.
.PHONY: check test

check:  ## set up and run `flashtriton check` (the notebook's checks) on this machine's GPU, or its CPU
	scripts/setup-venv.sh cpu,plot
	.venv/bin/flashtriton check --out out/check

test:  ## set up and run the test suite (through Triton's interpreter when there is no GPU)
	scripts/setup-venv.sh test
	.venv/bin/python -m pytest -q -n auto --maxprocesses=8
