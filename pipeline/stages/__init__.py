"""What happens to a unit's rows, stage by stage: preprocess (validate, chat template,
tokenize), the engine and its requests, sampling and structured output, completions, the
unit's results and statistics, and the replica's metrics."""
