//! A lexer for a tiny calculator language: numbers, names, operators, parentheses.

#[derive(Debug, Clone, PartialEq)]
pub enum Token {
    Number(f64),
    Name(String),
    Op(char),
    LParen,
    RParen,
}

#[derive(Debug, PartialEq)]
pub struct LexError {
    pub position: usize,
    pub message: String,
}

pub struct Lexer<'a> {
    chars: Vec<char>,
    pos: usize,
    _source: &'a str,
}

impl<'a> Lexer<'a> {
    pub fn new(source: &'a str) -> Self {
        Lexer { chars: source.chars().collect(), pos: 0, _source: source }
    }

    fn peek(&self) -> Option<char> {
        self.chars.get(self.pos).copied()
    }

    fn bump(&mut self) -> Option<char> {
        let c = self.peek();
        self.pos += 1;
        c
    }

    fn number(&mut self) -> Result<Token, LexError> {
        let start = self.pos;
        while let Some(c) = self.peek() {
            if c.is_ascii_digit() {
                self.bump();
            } else {
                break;
            }
        }
        let text: String = self.chars[start..self.pos].iter().collect();
        text.parse::<f64>().map(Token::Number).map_err(|_| LexError {
            position: start,
            message: format!("bad number {:?}", text),
        })
    }

    fn name(&mut self) -> Token {
        let start = self.pos;
        while let Some(c) = self.peek() {
            if c.is_alphanumeric() || c == '_' {
                self.bump();
            } else {
                break;
            }
        }
        Token::Name(self.chars[start..self.pos].iter().collect())
    }

    pub fn tokens(&mut self) -> Result<Vec<Token>, LexError> {
        let mut out = Vec::new();
        while let Some(c) = self.peek() {
            match c {
                ' ' | '\t' | '\n' => {
                    self.bump();
                }
                '0'..='9' | '.' => out.push(self.number()?),
                'a'..='z' | 'A'..='Z' | '_' => out.push(self.name()),
                '+' | '-' | '*' | '/' | '^' => {
                    self.bump();
                    out.push(Token::Op(c));
                }
                '(' => {
                    self.bump();
                    out.push(Token::LParen);
                }
                ')' => {
                    self.bump();
                    out.push(Token::RParen);
                }
                other => {
                    return Err(LexError {
                        position: self.pos,
                        message: format!("unexpected {:?}", other),
                    })
                }
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lexes_an_expression() {
        let tokens = Lexer::new("2 * (rate + 1)").tokens().unwrap();
        assert_eq!(tokens.len(), 7);
        assert_eq!(tokens[0], Token::Number(2.0));
        assert_eq!(tokens[3], Token::Name("rate".into()));
    }
}
