from patch_dsv4.cli import main

main()
