from streamapp.cli import main

main()
