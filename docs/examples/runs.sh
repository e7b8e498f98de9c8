# docs/running.md: two runs that differ in their schedule, the table of runs, their curves.
rm -rf /tmp/runsdemo
for s in cosine wsd; do
    show "python -m launcher.train train.steps=40 train.lr_schedule=$s logging.wandb.mode=disabled hydra.run.dir=/tmp/runsdemo/$s > /dev/null"
done
show python -m launcher.runs /tmp/runsdemo
show python -m launcher.runs plot /tmp/runsdemo/cosine /tmp/runsdemo/wsd --out /tmp/runsdemo/curves.png
