"""python -m mlx_flash <command> [args]"""

import sys

COMMANDS = {
    "convert": "mlx_flash.cli.convert",
    "generate": "mlx_flash.cli.generate",
    "chat": "mlx_flash.cli.chat",
    "calibrate": "mlx_flash.cli.calibrate",
    "benchmark": "mlx_flash.cli.benchmark",
    "eval": "mlx_flash.cli.eval",
    "verify": "mlx_flash.cli.verify",
    "doctor": "mlx_flash.cli.doctor",
    "server": "mlx_flash.cli.server",
}


def main():
    if len(sys.argv) < 2 or sys.argv[1] not in COMMANDS:
        print(f"usage: python -m mlx_flash {{{','.join(COMMANDS)}}} [args]", file=sys.stderr)
        return 2
    import importlib

    import mlx_flash  # noqa: F401  (sets up BLAS before mlx is imported)

    return importlib.import_module(COMMANDS[sys.argv[1]]).main(sys.argv[2:])


if __name__ == "__main__":
    sys.exit(main())
