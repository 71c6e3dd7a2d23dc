"""`python -m refserve.scheduler`: watch a tiny workload step by step."""

from refserve.scheduler.demo import main

main()
