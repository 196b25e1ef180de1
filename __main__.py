from polymq.gateway.cli import main

main()
