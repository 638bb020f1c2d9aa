"""`python -m megaheal ...`: the CLI without the console script (what a launcher runs on a node)."""

from megaheal.cli import app

app(prog_name="megaheal")
