package org.example.bank;

import java.math.BigDecimal;
import java.math.RoundingMode;
import java.time.Instant;
import java.util.ArrayList;
import java.util.Collections;
import java.util.List;

/** A customer account with a balance in one currency and its history. */
public class Account {
    public record Movement(Instant at, BigDecimal amount, String memo) {}

    private final String iban;
    private final String currency;
    private BigDecimal balance = BigDecimal.ZERO.setScale(2);
    private final List<Movement> history = new ArrayList<>();

    public Account(String iban, String currency) {
        this.iban = iban;
        this.currency = currency;
    }

    public String getIban() {
        return iban;
    }

    public String getCurrency() {
        return currency;
    }

    public BigDecimal getBalance() {
        return balance;
    }

    public List<Movement> getHistory() {
        return Collections.unmodifiableList(history);
    }

    public void deposit(BigDecimal amount, String memo) {
        requirePositive(amount);
        apply(amount, memo);
    }

    public void withdraw(BigDecimal amount, String memo) {
        requirePositive(amount);
        if (balance.compareTo(amount) < 0) {
            throw new IllegalStateException("insufficient funds on " + iban);
        }
        apply(amount.negate(), memo);
    }

    /**
     * Moves {@code amount} from this account to {@code target}, which must
     * hold the same currency; both histories record the transfer.
     */
    public void transferTo(Account target, BigDecimal amount, String memo) {
        if (target == this) {
            throw new IllegalArgumentException("cannot transfer to the same account");
        }
        if (!currency.equals(target.currency)) {
            throw new IllegalArgumentException("currency mismatch: " + currency + " vs " + target.currency);
        }
        withdraw(amount, "transfer to " + target.iban + ": " + memo);
        target.deposit(amount, "transfer from " + iban + ": " + memo);
    }

    private void apply(BigDecimal amount, String memo) {
        BigDecimal scaled = amount.setScale(2, RoundingMode.HALF_EVEN);
        balance = balance.add(scaled);
        history.add(new Movement(Instant.now(), scaled, memo));
    }

    private static void requirePositive(BigDecimal amount) {
        if (amount == null || amount.signum() <= 0) {
            throw new IllegalArgumentException("amount must be positive");
        }
    }

    @Override
    public String toString() {
        return iban + " " + balance.toPlainString() + " " + currency;
    }
}
