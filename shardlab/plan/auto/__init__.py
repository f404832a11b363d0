"""The layout search (`--strategy auto`, `sl.auto_layout`, `shardlab plan train --search
--compile`): candidates ranked by formula, the best compiled, one chosen."""
