"""What the benchmark scripts share: the gradient trees and their layouts (trees), timed
rounds and the max_norm schedule (timing), the profiler's device time and compiled-HLO
summaries (profiling), the torch baseline (torch_baseline), the single-device clips and
steps (clips), the sharded clips and training step (sharded, train_step), the printed
tables (tables), the JSON record every benchmark writes (record), and the command lines
(cli). examples/benchmark.py, the example's step, uses them too, with its targets
(targets), the clip's cost split in two (state_split) and the GPT in torch (torch_gpt)."""
