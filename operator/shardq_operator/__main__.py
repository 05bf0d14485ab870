"""`python -m shardq_operator`: the same as `shardq operator`."""

from shardq_operator.cli import operator_command

operator_command()
