//! Trains a model config through `meshrun_run_train`, printing each step's
//! loss on rank 0: `meshrun launch --nproc-per-node 2 -- train_llama
//! CONFIG.toml OUTPUT [key=value ...]`.
use std::process::ExitCode;

fn loss_of(metrics: &str) -> Option<&str> {
    let start = metrics.find("\"loss\":")? + "\"loss\":".len();
    let end = metrics[start..].find(|c| c == ',' || c == '}')? + start;
    Some(&metrics[start..end])
}

fn train(config: &str, output: &str, overrides: &[String]) -> meshrun::Result<()> {
    let mut runtime = meshrun::Runtime::from_file(config)?;
    for assignment in overrides {
        runtime.set(assignment)?;
    }
    runtime.join()?;
    let (rank, size, _) = runtime.rank()?;
    meshrun::Run::new(&mut runtime)
        .output_dir(output)
        .on_step(|metrics| {
            if rank == 0 {
                println!("rust host: {} ranks, loss {}", size, loss_of(metrics).unwrap_or("?"));
            }
            true
        })
        .train()
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    if args.len() < 3 {
        eprintln!("usage: train_llama CONFIG.toml OUTPUT [key=value ...]");
        return ExitCode::from(2);
    }
    match train(&args[1], &args[2], &args[3..]) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("train_llama: {}", error);
            ExitCode::from(if error.code == 1 { 2 } else { 1 })
        }
    }
}
