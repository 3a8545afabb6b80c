from harbor_async.cli import main

main()
