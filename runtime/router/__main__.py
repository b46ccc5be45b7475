from pdcluster.runtime.router.cli import main

main()
