for r in 1 2; do for v in 6 7; do
  if [ $v = 6 ]; then D=<a worktree of 7d380f2>; else D=<this checkout>; fi
  cd $D
  export MLX_FLASH_HOME=/tmp/h$v PYTHONPATH=$D
  <this checkout>/.venv/bin/python -c "import mlx_flash.plan.profile as p; print('VERSION', p.VERSION, p.__file__)" >> /tmp/ab67-$v-$r.log 2>&1
  <this checkout>/.venv/bin/python -m mlx_flash.cli.benchmark profile >> /tmp/ab67-$v-$r.log 2>&1
  <this checkout>/.venv/bin/python -m mlx_flash.cli.benchmark peers --systems mlx_flash:auto,mlx_flash:dense@none,mlx_flash:hybrid,mlx_flash:naive --limit 50% --tokens 64 --rounds 1 --out /tmp/ab67-$v-$r >> /tmp/ab67-$v-$r.log 2>&1
done; done
echo DONE > /tmp/ab67.done
