from longfit.cli import console

console()
