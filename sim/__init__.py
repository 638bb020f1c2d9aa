"""The reliability simulator: a long job on a large cluster, its failures drawn from a public failure record, healed by
megaheal's real policy (`megaheal simulate`, docs/simulation.md)."""
