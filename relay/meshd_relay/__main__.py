from meshd_relay.cli import main

main()
