from dspark_cli.cli import main

main()
