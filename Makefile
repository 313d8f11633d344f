# The two commands of the README: `make up` and `make test`.
.PHONY: up test properties lint css messages

up:
	@scripts/bootstrap
	.venv/bin/llmgw up

test:
	@scripts/bootstrap dev
	scripts/test

# The property tests at their full example counts (the suite draws a fifth of each): a nightly job.
properties:
	@scripts/bootstrap dev
	LLMGW_TEST_FULL_PROPERTIES=1 LLMGW_DATA_DIR=$$(mktemp -d) .venv/bin/python -m pytest -m properties

lint:
	@scripts/bootstrap dev
	.venv/bin/ruff check .

# Rebuild the committed stylesheet (needs Node and the npm registry; running llmgw does not).
css:
	cd llmgw/theme/static_src && npm ci --no-audit --no-fund && npm run build

# Refresh the Turkish catalogue after changing user-facing strings, then compile it.
messages:
	.venv/bin/python manage.py makemessages -l tr --no-location --ignore '.venv/*' --ignore 'node_modules/*'
	.venv/bin/python manage.py compilemessages -l tr
