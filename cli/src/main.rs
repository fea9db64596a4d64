//! `shardcast`: the operator CLI (see `shardcast_cli`).

use clap::Parser;
use shardcast_cli::{Cli, run};

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let cli = Cli::parse();
    if let Err(e) = run(cli).await {
        eprintln!("error: {}", e.message);
        std::process::exit(e.exit);
    }
}
