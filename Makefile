# The two commands of the README: `make up` and `make test`.
.PHONY: up test lint css messages

up:
	@scripts/bootstrap
	.venv/bin/llmgw up

test:
	@scripts/bootstrap dev
	scripts/test

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
