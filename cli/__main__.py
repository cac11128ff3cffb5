from eagle3.cli.main import main

main()
