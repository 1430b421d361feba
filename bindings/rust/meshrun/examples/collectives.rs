//! Every collective of the safe wrapper's `Comm` on the world communicator,
//! checked against what each rank can compute alone, for f32, i32 and i64:
//! `meshrun launch --nproc-per-node N -- collectives CONFIG.toml`. Prints
//! "collectives: rank R of N ok" or the first difference, exit 1.
use std::process::ExitCode;

use meshrun::{Reduce, Runtime};

fn expect<T: PartialEq + std::fmt::Debug>(what: &str, got: &[T], want: &[T]) -> Result<(), String> {
    if got == want {
        Ok(())
    } else {
        Err(format!("{}: got {:?}, want {:?}", what, got, want))
    }
}

fn check(config: &str) -> Result<(i64, i64), String> {
    let fail = |error: meshrun::Error| error.to_string();
    let mut runtime = Runtime::from_file(config).map_err(fail)?;
    runtime.join().map_err(fail)?;
    let mut world = runtime.comm("world").map_err(fail)?;
    let (rank, size) = (world.rank().map_err(fail)?, world.size().map_err(fail)?);
    let ranks: Vec<i64> = (0..size).collect();

    // all_reduce: sum, max and average of [r, 10 r + 1] over ranks r.
    let mut sum = [rank as f32, 10.0 * rank as f32 + 1.0];
    world.all_reduce(&mut sum, Reduce::Sum).map_err(fail)?;
    let total: i64 = ranks.iter().sum();
    expect(
        "all_reduce sum f32",
        &sum,
        &[total as f32, 10.0 * total as f32 + size as f32],
    )?;
    let mut top = [rank as i32, -(rank as i32)];
    world.all_reduce(&mut top, Reduce::Max).map_err(fail)?;
    expect("all_reduce max i32", &top, &[size as i32 - 1, 0])?;
    let mut mean = [2.0 * rank as f32];
    let op = world
        .all_reduce_start(&mut mean, Reduce::Avg)
        .map_err(fail)?;
    op.wait(-1.0).map_err(fail)?;
    expect("all_reduce_start avg f32", &mean, &[(size - 1) as f32])?;

    // all_gather of [r, r + 100] (i64): every rank's pair in rank order.
    let mut gathered = vec![0i64; 2 * size as usize];
    world
        .all_gather(&[rank, rank + 100], &mut gathered)
        .map_err(fail)?;
    let want: Vec<i64> = ranks.iter().flat_map(|&r| [r, r + 100]).collect();
    expect("all_gather i64", &gathered, &want)?;

    // reduce_scatter: rank r sends [r; size]; each gets the sum, one element.
    let mut part = [0.0f32];
    world
        .reduce_scatter(
            &vec![rank as f32 + 1.0; size as usize],
            &mut part,
            Reduce::Sum,
        )
        .map_err(fail)?;
    expect("reduce_scatter sum f32", &part, &[(total + size) as f32])?;

    // broadcast from the last rank.
    let mut value = [rank * 7];
    world.broadcast(&mut value, size - 1).map_err(fail)?;
    expect("broadcast i64", &value, &[(size - 1) * 7])?;

    // all_to_all: rank r sends peer p (p + 1) copies of 1000 r + p; so it
    // receives r + 1 elements from each peer p: 1000 p + r.
    let send_counts: Vec<i64> = ranks.iter().map(|&p| p + 1).collect();
    let send: Vec<i32> = ranks
        .iter()
        .flat_map(|&p| vec![(1000 * rank + p) as i32; (p + 1) as usize])
        .collect();
    let recv_counts = vec![rank + 1; size as usize];
    let mut received = vec![0i32; ((rank + 1) * size) as usize];
    world
        .all_to_all(&send, &send_counts, &mut received, &recv_counts)
        .map_err(fail)?;
    let want: Vec<i32> = ranks
        .iter()
        .flat_map(|&p| vec![(1000 * p + rank) as i32; (rank + 1) as usize])
        .collect();
    expect("all_to_all i32, uneven counts", &received, &want)?;
    let refused = world.all_to_all(&send, &send_counts[1..], &mut received, &recv_counts);
    if refused.is_ok() {
        return Err("all_to_all with one count too few was accepted".to_string());
    }

    // A ring: each rank starts a send to the next and receives from the
    // previous, then waits for its send.
    let next = (rank + 1) % size;
    let previous = (rank + size - 1) % size;
    let outgoing = [rank as f32 * 0.5; 3];
    let sent = world.send_start(&outgoing, next, 7).map_err(fail)?;
    let mut incoming = [0.0f32; 3];
    world.recv(&mut incoming, previous, 7).map_err(fail)?;
    sent.wait(-1.0).map_err(fail)?;
    expect("ring send/recv f32", &incoming, &[previous as f32 * 0.5; 3])?;

    world.barrier().map_err(fail)?;
    Ok((rank, size))
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    if args.len() != 2 {
        eprintln!("usage: collectives CONFIG.toml");
        return ExitCode::from(2);
    }
    match check(&args[1]) {
        Ok((rank, size)) => {
            println!("collectives: rank {} of {} ok", rank, size);
            ExitCode::SUCCESS
        }
        Err(message) => {
            eprintln!("collectives: {}", message);
            ExitCode::from(1)
        }
    }
}
