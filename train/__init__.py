"""megaheal's fully parallel trainer: GPT with data, tensor, sequence and pipeline parallelism."""
