from shardq.cli import main

main()
