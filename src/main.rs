fn main() {
    consul_resolver_operator::main();
}
